"""Which files of a repo a download takes, as `hf download` has it: named files (`config.json`, a folder
as `original/`), or else `--include` / `--exclude` glob patterns, matched as huggingface_hub matches them
(filter_repo_objects). A named file the repo lacks is an error with the nearest name, never a silent
download of everything."""

from __future__ import annotations

import re
from dataclasses import dataclass

from huggingface_hub.utils import filter_repo_objects

from ckpttool.errors import InputError, did_you_mean, printable


def _literal(name: str) -> str:
    """A file name as a glob pattern that matches only itself (fnmatch: `[*]` is a literal `*`)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


@dataclass(frozen=True, slots=True)
class Selection:
    files: tuple[str, ...] = ()
    """exact names; one ending in `/` is a folder, everything under it"""
    allow: tuple[str, ...] | None = None
    ignore: tuple[str, ...] | None = None

    @classmethod
    def of(cls, files=None, allow=None, ignore=None) -> "Selection":
        def as_tuple(v):
            return None if v is None else (v,) if isinstance(v, str) else tuple(v)

        return cls(as_tuple(files) or (), as_tuple(allow), as_tuple(ignore))

    def patterns(self) -> tuple[list[str] | None, list[str] | None]:
        """(allow_patterns, ignore_patterns) for the hub client: named files match only themselves."""
        if self.files:
            return [_literal(f.rstrip("/")) + "/*" if f.endswith("/") else _literal(f) for f in self.files], None
        return (None if self.allow is None else list(self.allow)), (None if self.ignore is None else list(self.ignore))

    def pick(self, listing: dict, where: str) -> dict:
        """The entries of `listing` (name -> anything) this selection takes; refuses a named file the repo
        lacks and patterns that match nothing."""
        if self.files:
            for name in self.files:
                folder = name.rstrip("/") + "/"
                if name not in listing and not any(n.startswith(folder) for n in listing):
                    top = sorted({n.split("/")[0] + ("/" if "/" in n else "") for n in listing})
                    raise InputError(f"{where} has no file {printable(name)!r}"
                                     f"{did_you_mean(name, listing) or did_you_mean(name, top)}",
                                     fix=f"name a file of the repo ({', '.join(top[:8])}{' ...' if len(top) > 8 else ''}); "
                                         "to download into a directory, pass --local-dir DIR")
        allow, ignore = self.patterns()
        wanted = {n: listing[n] for n in filter_repo_objects(listing, allow_patterns=allow, ignore_patterns=ignore)}
        if not wanted:
            raise InputError(f"no file of {where} matches allow_patterns={allow} ignore_patterns={ignore}",
                             fix="loosen the patterns; `ckpttool download` without them fetches every file")
        return wanted
