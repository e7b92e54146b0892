"""Eval mode: runs, leases, turns, continuity, verified resets, replay, snapshots, diffs."""
