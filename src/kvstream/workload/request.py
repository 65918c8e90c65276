"""The one request type every reader and generator produces and every driver consumes."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["Request", "CHUNK_TOKENS"]

CHUNK_TOKENS = 256  # tokens per KV chunk (LMCache's default); every chunk id below covers this many tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One inference request as a storage engine sees it.

    ``chunk_ids`` names the prompt's full 256-token chunks, prefix-chained: two requests whose ``chunk_ids``
    agree on the first ``i`` entries share the first ``i * 256`` prompt tokens, so the id of chunk ``i`` stands
    for tokens ``0 .. (i+1)*256``. Tokens of a trailing partial chunk are in ``input_tokens`` but have no id
    (they are always recomputed, as in LMCache).
    """

    request_id: int  # unique within a workload, in arrival order
    arrival: float  # seconds since the workload's start
    input_tokens: int  # prompt length in tokens
    output_tokens: int  # tokens to generate
    chunk_ids: tuple[Hashable, ...]  # one per full chunk of the prompt; len == input_tokens // CHUNK_TOKENS
    session: Hashable | None = None  # conversation / user id; None for one-shot requests
    round_index: int = 0  # turn number within the session (0 = first)
    prev_answer_tokens: int | None = None  # the session's previous answer length (Bidaw's predictor input)
    new_tokens: int | None = None  # prompt tokens not in this session's previous prompt (query + previous answer); None = unknown

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"request {self.request_id}: negative token count")
        if self.new_tokens is not None and not 0 <= self.new_tokens <= self.input_tokens:
            raise ValueError(f"request {self.request_id}: new_tokens {self.new_tokens} outside 0..{self.input_tokens}")
        if self.arrival < 0:
            raise ValueError(f"request {self.request_id}: negative arrival time {self.arrival}")
        if len(self.chunk_ids) != self.input_tokens // CHUNK_TOKENS:
            raise ValueError(
                f"request {self.request_id}: {len(self.chunk_ids)} chunk ids for {self.input_tokens} tokens "
                f"(expected {self.input_tokens // CHUNK_TOKENS})"
            )
