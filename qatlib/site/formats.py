"""The formats x runtimes table, from `qatlib.runtime.facts` (never typed).

One row per export layout, naming the presets (`qatlib.quant.spec.PRESETS`) that export it; one
column per deployment target: whether that runtime loads it (dense / MoE, which GPU compute
capabilities) and how many load-time transformations it applies to the trained scales. `render`
is the README's compact table; `render_detailed` adds the reasons and the transformations with the
runtime source line each is read from (docs/reference/formats.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from qatlib.quant.spec import PRESETS
from qatlib.runtime import facts

# compute capabilities probed for a capability-bound layout (Turing .. Blackwell)
CAPABILITIES = ("7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
DISPLAY = {"vllm": "vLLM", "sglang": "SGLang"}


def runtime_name(rt: facts.Runtime) -> str:
    return f"{DISPLAY.get(rt.name, rt.name)} {rt.version}"


@dataclass(frozen=True)
class Support:
    """What one runtime does with one layout."""

    dense: facts.Fact | None  # the refusal, None: loads
    moe: facts.Fact | None
    capabilities: tuple[str, ...]  # those it loads on; all of CAPABILITIES: not capability-bound
    capability_fact: facts.Fact | None
    transforms: list[tuple[facts.Transform, facts.Fact]]

    @property
    def loads(self) -> bool:
        return self.dense is None or self.moe is None

    def summary(self) -> str:
        if not self.loads:
            return "refused"
        where = (
            "loads"
            if self.dense is None and self.moe is None
            else "dense only (MoE refused)"
            if self.dense is None
            else "MoE only (dense refused)"
        )
        if len(self.capabilities) < len(CAPABILITIES):
            where += f" (SM {', '.join(self.capabilities)})" if self.capabilities else " (no GPU)"
        n = len(self.transforms)
        return where + (f"; {n} load-time change{'s' if n > 1 else ''}" if n else "")


def support(target: str, layout: facts.Layout) -> Support:
    dense = facts.load_refusal(target, layout, moe=False)
    moe = facts.load_refusal(target, layout, moe=True)
    caps, cap_fact = [], None
    for c in CAPABILITIES:
        why = facts.load_refusal(target, layout, moe=False, capability=c)
        if why is None or why is dense:
            caps.append(c)
        elif dense is None:
            cap_fact = why
    return Support(dense, moe, tuple(caps), cap_fact, facts.transforms(target, layout))


def layouts() -> dict[facts.Layout, list[str]]:
    """Each export layout and the presets that export it, in preset order."""
    out: dict[facts.Layout, list[str]] = {}
    for name, scheme in PRESETS.items():
        out.setdefault(facts.layout_of(scheme), []).append(name)
    return out


def _names(presets: list[str]) -> str:
    return ", ".join(f"`{p}`" for p in presets)


def render() -> str:
    """The compact table (README)."""
    targets = list(facts.TARGETS.values())
    lines = [
        "| format (`compression.quantization.name`) | export layout | "
        + " | ".join(map(runtime_name, targets))
        + " |",
        "|---" * (2 + len(targets)) + "|",
    ]
    for layout, presets in layouts().items():
        cells = [support(t.name, layout).summary() for t in targets]
        lines.append(f"| {_names(presets)} | {layout.value} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fact(f: facts.Fact) -> str:
    return f"{f.what} (`{f.source}`)"


def render_detailed() -> str:
    """Per layout: each runtime's verdict, why, and the load-time transformations (docs)."""
    lines = [render(), ""]
    for layout, presets in layouts().items():
        lines += [f"### {layout.value}", "", f"Presets: {_names(presets)}.", ""]
        for t in facts.TARGETS.values():
            s = support(t.name, layout)
            lines.append(f"- **{runtime_name(t)}**: {s.summary()}.")
            for label, why in (("dense", s.dense), ("MoE", s.moe)):
                if why is not None and (label == "dense" or why is not s.dense):
                    lines.append(f"    - refuses {label}: {_fact(why)}")
            if s.capability_fact is not None:
                lines.append(f"    - capability: {_fact(s.capability_fact)}")
            for tr, f in s.transforms:
                lines.append(f"    - at load: {tr.value} (`{f.source}`)")
        lines.append("")
    return "\n".join(lines).rstrip("\n")
