"""Which format each tensor is in: the config's rules, resolved against the headers.

A `Rule` is one row of the format table as a config declares it: the row, where the config says so (for
messages), and which modules it covers (compressed-tensors' `targets` / `ignore`, transformers'
`modules_to_not_convert`, DeepSeek-V4's `expert_dtype` for the routed experts). A checkpoint may mix formats
(DeepSeek-V4: MXFP4 experts beside FP8 128x128 blocks), so every tensor is resolved on its own: its dtype,
its name and the side tensors beside it (headers) pick the rules that could hold it, and exactly one must:
a tensor two rules claim is refused naming both; one that looks quantized while no rule claims it is refused
naming what is missing. Nothing is guessed from a format's name outside its row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

from ckpttool.errors import InputError
from ckpttool.formats.row import QuantFormat

_PLAIN = ("BF16", "F16", "F32")


@dataclass(frozen=True, slots=True)
class Rule:
    row: QuantFormat
    origin: str
    """where the config declares it, for messages (`quantization_config.config_groups.group_0`)"""
    targets: tuple[str, ...] = ()
    """module names it covers: `re:<regex>` (re.match), an exact module name or a final part of one; a bare
    class name (`Linear`) covers every module, as headers cannot tell classes apart. Empty: every module."""
    ignore: tuple[str, ...] = ()
    """module names it never covers, in the same forms (class names excepted: they ignore nothing here)"""

    def covers(self, module: str) -> bool:
        if any(_names(pattern, module) for pattern in self.ignore):
            return False
        return not self.targets or any(_names(p, module) or _is_class(p) for p in self.targets)


def _is_class(pattern: str) -> bool:
    return not pattern.startswith("re:") and "." not in pattern and pattern[:1].isupper()


def _names(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def module_of(base: str) -> str:
    """`a.b.weight` -> `a.b` (what configs name); a name without `.weight` is its own module."""
    return base[: -len(".weight")] if base.endswith(".weight") else base


@dataclass(frozen=True, slots=True)
class Match:
    """One quantized weight: its row, dequantized name, stored values and side tensors (role -> name, those
    present in the checkpoint), and the rule that claimed it."""

    row: QuantFormat
    base: str
    values: str
    members: dict[str, str]
    rule: Rule

    @property
    def sides(self) -> tuple[str, ...]:
        """The names the executor reads, in the row's order (TensorPlan.sides)."""
        return tuple(self.members[s.role] for s in self.row.read_sides)

    def present(self) -> set[str]:
        return {self.values, *self.members.values()}


Header = Mapping[str, tuple[str, tuple[int, ...]]]
"""tensor name -> (dtype, shape)"""


def _candidates(name: str, dtype: str, header: Header, rules: tuple[Rule, ...]) -> list[Match]:
    found = []
    for rule in rules:
        row = rule.row
        if dtype not in row.value_dtypes or (base := row.values.base_of(name)) is None:
            continue
        members = row.members(base)
        if any(not s.optional and members[s.role] not in header for s in row.sides):
            continue
        if rule.covers(module_of(base)):
            found.append(Match(row, base, name, {r: n for r, n in members.items() if n in header}, rule))
    return found


def _sides_fit(m: Match, header: Header) -> bool:
    return all(not s.dtypes or header[m.members[s.role]][0] in s.dtypes for s in m.row.sides if s.role in m.members)


def _shapes_fit(m: Match, header: Header) -> bool:
    try:
        check_shapes(m, header, None)
    except InputError:
        return False
    return True


def check_shapes(m: Match, header: Header, file) -> None:
    """The row's own check of the values' and sides' shapes (an InputError naming the tensor)."""
    shapes = {role: header[n][1] for role, n in m.members.items()}
    m.row.check(header[m.values][1], shapes, m.members, file)


def resolve(header: Header, rules: tuple[Rule, ...], file_of: Callable[[str], object] = lambda n: None
            ) -> dict[str, Match]:
    """stored values name -> its Match, for every tensor exactly one rule claims. Where several rows could
    hold a tensor, the side tensors' dtypes and then the rows' shape checks choose; if more than one row is
    left, the tensor is refused naming them."""
    out: dict[str, Match] = {}
    for name, (dtype, _) in header.items():
        found = _candidates(name, dtype, header, rules)
        if len({m.row.name for m in found}) > 1:
            found = [m for m in found if _sides_fit(m, header)] or found
        if len({m.row.name for m in found}) > 1:
            found = [m for m in found if _shapes_fit(m, header)] or found
        rows = {m.row.name: m for m in found}
        if len(rows) > 1:
            raise InputError("tensor fits more than one declared format: " + "; ".join(
                f"{m.row.title} ({m.rule.origin})" for m in rows.values()), file=file_of(name), tensor=name,
                fix="config.json's quantization_config declares overlapping formats for this module; "
                    "fix its targets/ignore lists")
        if found:
            out[name] = found[0]
    return out


def members_of(matches: Mapping[str, Match]) -> set[str]:
    """Every stored name that belongs to a quantized weight (values and sides)."""
    return set().union(*(m.present() for m in matches.values())) if matches else set()


def unclaimed(header: Header, rules: tuple[Rule, ...], matches: Mapping[str, Match],
              file_of: Callable[[str], object] = lambda n: None) -> None:
    """Refuse every tensor that looks quantized (a format's values or a side of one, by name and dtype)
    while no rule claims it, saying what is missing."""
    taken = members_of(matches)
    for name, (dtype, _) in header.items():  # values without their sides first: the cause, not the symptom
        if name not in taken:
            _check_values(name, dtype, header, rules, file_of(name))
    for name, (dtype, _) in header.items():
        if name not in taken:
            _check_side(name, dtype, header, rules, file_of(name))


def _check_values(name: str, dtype: str, header: Header, rules: tuple[Rule, ...], file) -> None:
    fits = []  # (rule, base, missing sides) of every rule whose values this tensor could be
    for rule in rules:
        base = rule.row.values.base_of(name)
        if base is not None and dtype in rule.row.value_dtypes:
            fits.append((rule, base, [s.name.of(base) for s in rule.row.sides
                                      if not s.optional and s.name.of(base) not in header]))
    if not fits:
        return
    complete = [(rule, base) for rule, base, missing in fits if not missing]
    if complete:  # the tensors are all there: the config does not cover this module
        rule, base = complete[0]
        raise InputError(f"tensor is stored as {rule.row.title}, but {rule.origin} does not cover module "
                         f"{module_of(base)!r}", file=file, tensor=name,
                         fix="config.json's quantization_config does not describe this checkpoint; "
                             "re-download config.json or fix its targets/ignore lists")
    rule, _, missing = fits[0]
    raise InputError(f"{rule.row.title} weight has no {missing[0]!r}", file=file, tensor=name,
                     fix="the checkpoint is incomplete (or the index lost the entry); re-download it")


def _check_side(name: str, dtype: str, header: Header, rules: tuple[Rule, ...], file) -> None:
    for rule in rules:
        row = rule.row
        for side in row.sides:
            base = side.name.base_of(name)
            if base is None or side.optional:
                continue
            values = row.values.of(base)
            # values stored in another quantized dtype are the cause (whatever this side's dtype: NVFP4 tensors under
            # an FP8 config); a float `X.weight` is simply unquantized
            if values in header and header[values][0] not in (*row.value_dtypes, *_PLAIN):
                raise InputError(f"{values!r} is {header[values][0]}, but {row.title} ({rule.origin}) stores its "
                                 f"values as {' or '.join(row.value_dtypes)}", file=file, tensor=values,
                                 fix="config.json's quantization_config does not describe how this tensor is stored: "
                                     "fix it (or re-download the checkpoint)")
            if dtype in side.dtypes:
                raise InputError(f"{side.role} has no quantized weight beside it", file=file, tensor=name,
                                 fix="the checkpoint is incomplete; re-download it")
