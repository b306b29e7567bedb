"""Tolerant Prometheus text parsing (prometheus_client's parser, one family at a time).

``prometheus_client.parser.text_string_to_metric_families`` gives up on the first bad line. Scraped peers can
send partly broken text, so :func:`parse_families` first tries the whole text and, if that fails, re-parses
family by family (split on ``# HELP`` / ``# TYPE`` headers), keeping the good families and reporting how many
blocks were skipped. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass(slots=True)
class ParsedText:
    """Samples by sample name (e.g. ``vllm:prompt_tokens_total``) plus the family types and a skip count."""

    samples: dict[str, list[Sample]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # family name -> counter/gauge/histogram/...
    broken_blocks: int = 0  # text blocks that failed to parse and were skipped

    def get(self, name: str) -> list[Sample]:
        return self.samples.get(name, [])


def _add(out: ParsedText, families: Iterable[object]) -> None:
    for fam in families:
        out.types[fam.name] = fam.type  # type: ignore[attr-defined]
        for s in fam.samples:  # type: ignore[attr-defined]
            out.samples.setdefault(s.name, []).append(s)


def _blocks(text: str) -> list[str]:
    """Split exposition text into blocks; a run of ``# HELP``/``# TYPE`` lines starts a block."""
    blocks: list[list[str]] = [[]]
    prev_header = False
    for line in text.splitlines():
        header = line.startswith(("# HELP ", "# TYPE "))
        if header and not prev_header and blocks[-1]:
            blocks.append([])
        blocks[-1].append(line)
        prev_header = header
    return ["\n".join(b) + "\n" for b in blocks if b]


def parse_families(text: str) -> ParsedText:
    """Parse exposition text; broken family blocks are skipped and counted in ``broken_blocks``."""
    out = ParsedText()
    try:
        _add(out, list(text_string_to_metric_families(text)))
        return out
    except Exception:  # noqa: BLE001 - fall back to per-block parsing
        out = ParsedText()
    for block in _blocks(text):
        try:
            fams = list(text_string_to_metric_families(block))
        except Exception:  # noqa: BLE001
            out.broken_blocks += 1
            continue
        _add(out, fams)
    return out
