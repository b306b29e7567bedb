"""Tolerant Prometheus text parsing (prometheus_client's parser, one family at a time).

``prometheus_client.parser.text_string_to_metric_families`` gives up on the first bad line. Scraped peers can
send partly broken text, so :func:`parse_families` first tries the whole text and, if that fails, re-parses
family by family (split where ``# HELP`` / ``# TYPE`` headers of a new name begin), keeping the good
families and reporting how many blocks were skipped. A caller that reads a few series of a large text
passes ``keep`` (sample names): the other sample lines are dropped before the parser sees them (headers
stay, so every family's name and type is still known). That parser is pure Python and costs the sidecar
CPU on the engine's host at every scrape; ``bench/scrape_parse_cost.py`` measures the saving. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
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


def _header_name(line: str) -> str | None:
    """Metric name of a ``# HELP``/``# TYPE`` line, else None."""
    if not line.startswith(("# HELP ", "# TYPE ")):
        return None
    parts = line.split(None, 3)
    return parts[2] if len(parts) > 2 else ""


def _blocks(text: str) -> list[str]:
    """Split exposition text into blocks: each run of ``# HELP``/``# TYPE`` lines of one metric name starts a
    block (so a broken header never takes the next family's headers and samples with it)."""
    blocks: list[list[str]] = [[]]
    cur: str | None = None  # name of the header run the previous line belonged to
    for line in text.splitlines():
        name = _header_name(line)
        if name is not None and name != cur and blocks[-1]:
            blocks.append([])
        blocks[-1].append(line)
        cur = name
    return ["\n".join(b) + "\n" for b in blocks if b]


_SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?=[{ \t])")  # a metric name, then labels or a blank


def keep_samples(text: str, names: Collection[str]) -> str:
    """``text`` without the sample lines of well-formed metric names not in ``names``. Comment lines stay, and
    so does a line that does not start with a metric name (junk in the text): the parser then reports it as a
    broken block instead of the junk passing unseen."""

    def wanted(line: str) -> bool:
        if line.startswith("#") or not line.strip():
            return True
        m = _SAMPLE_NAME.match(line)
        return m is None or m.group() in names

    return "".join(line for line in text.splitlines(keepends=True) if wanted(line))


def parse_families(text: str, keep: Collection[str] | None = None) -> ParsedText:
    """Parse exposition text; broken family blocks are skipped and counted in ``broken_blocks``. With ``keep``
    only the samples of those sample names are parsed (``types`` still lists every family)."""
    if keep is not None:
        text = keep_samples(text, keep)
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
