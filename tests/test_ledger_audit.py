"""kvledger audit chain's rules on records alone: a healthy chain passes, tampering does not."""

from __future__ import annotations

from typing import Any

from router.ledger.audit import audit_chain
from router.ledger.chain import genesis, step, text_digest

ENGINE = "engine-1"


def chain(count: int, *, generation: int = 7, start: str | None = None) -> list[dict[str, Any]]:
    """``count`` records of one generation, as the step script writes them."""
    state = genesis(ENGINE) if start is None else start
    records = []
    for seq in range(count):
        digest = text_digest(f"request {generation}.{seq}")
        after = step(state, digest)
        records.append(
            {
                "request_id": f"g{generation}-{seq}",
                "generation": generation,
                "seq": seq,
                "engine_digest": ENGINE,
                "digest": digest,
                "state_before": state,
                "state_after": after,
                "state_known": start is None,
                "stale": False,
                "unordered": False,
            }
        )
        state = after
    return records


def test_a_healthy_chain_has_no_finding() -> None:
    """Two generations, each from genesis: nothing to report."""
    audit = audit_chain("r1", chain(5) + chain(3, generation=8))
    assert audit.ok and audit.findings == []
    assert (audit.records, audit.generations, audit.counts["unknown"]) == (8, 2, 0)


def test_a_record_deleted_by_hand_is_a_gap() -> None:
    """A missing seq inside a generation is reported with the seqs that are missing."""
    records = chain(6)
    del records[2]
    audit = audit_chain("r1", records)
    assert not audit.ok and audit.counts["gap"] == 1
    assert audit.findings == ["r1: gap: seq 2 to 2 missing before request g7-3"]


def test_a_record_edited_by_hand_is_a_break() -> None:
    """An edited digest no longer hashes to the record's state_after."""
    records = chain(4)
    records[1] = {**records[1], "digest": text_digest("something else")}
    audit = audit_chain("r1", records)
    assert audit.counts["break"] == 1 and "g7-1" in audit.findings[0]


def test_an_edited_state_breaks_the_link_to_the_next_record() -> None:
    """A rewritten state_after breaks the record itself and the next one's start."""
    records = chain(4)
    records[1] = {**records[1], "state_after": "0" * 40}
    assert audit_chain("r1", records).counts["break"] == 2


def test_a_record_written_twice_is_a_duplicate() -> None:
    """The same request id twice in a stream is reported once per repeat."""
    records = chain(3)
    audit = audit_chain("r1", [*records, records[1]])
    assert audit.counts["duplicate"] == 1 and not audit.ok


def test_unknown_unordered_and_stale_records_are_counted_not_errors() -> None:
    """A chain from a state nobody saw empty, a step whose order was lost (a fresh unknown state)
    and a stale request are what the records say they are: counted, not errors."""
    records = chain(3, start="f" * 40)
    lost = {**records[2], "unordered": True, "state_after": "e" * 40}
    stale = {"request_id": "late", "generation": 6, "stale": True}
    audit = audit_chain("r1", [*records[:2], lost, stale])
    assert audit.ok
    assert [audit.counts[k] for k in ("unknown", "unordered", "stale")] == [3, 1, 1]


def test_a_known_start_that_is_not_genesis_is_a_break() -> None:
    """A generation whose first record says its cache was seen empty must start at genesis."""
    records = chain(2)
    records[0] = {**records[0], "state_before": "a" * 40}
    assert audit_chain("r1", records).counts["break"] >= 1


def test_a_stream_trimmed_by_its_cap_is_not_an_error() -> None:
    """The oldest records cut by the stream's length cap leave a first record above seq 0."""
    audit = audit_chain("r1", chain(6)[3:])
    assert audit.ok and audit.counts["trimmed"] == 1
