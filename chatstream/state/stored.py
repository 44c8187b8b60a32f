"""How callers and teams (callers.py), prices (prices.py) and owner rows (owners.py) are kept as
table rows: each is a ``Stored``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any, Self

from pydantic import ConfigDict, ValidationError
from pydantic.dataclasses import dataclass


@dataclass(frozen=True, config=ConfigDict(strict=True))
class Stored:
    """An object kept as one row (pydantic checks its types, strictly, whenever one is made), as
    its row keeps its properties (``entity``) and back (``of``; a property left out
    or empty: the field's default; a whole-number Double, a number typed in by hand, as its integer):
    times as ISO text, the model list, the per-model limits and a price (an owner row's) as JSON."""

    def entity(self) -> dict[str, Any]:
        row: dict[str, Any] = {}
        for f in fields(self):
            item = getattr(self, f.name)
            if isinstance(item, datetime):
                item = iso(item)
            elif f.name == "models" and item is not None:
                item = json.dumps(list(item))
            elif f.name == "model_limits":
                item = json.dumps({m: limit.model_dump() for m, limit in item.items()}) if item else None
            elif isinstance(item, Stored):
                item = json.dumps(item.entity())
            row[f.name] = item
        return row

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Self:
        """What ``row`` keeps; ValueError naming the field and why (never its value) when it holds
        none: a field missing, not JSON, or of another type (a hand edit, a bad write: registry.py)."""
        values = {f.name: row[f.name] for f in fields(cls) if row.get(f.name) not in (None, "")}
        for name, item in values.items():
            try:
                if name.endswith("_at") and isinstance(item, str):
                    values[name] = datetime.fromisoformat(item)
                elif name in ("models", "model_limits"):
                    item = json.loads(item)
                    values[name] = tuple(item) if name == "models" and isinstance(item, list) else item
                elif isinstance(item, float) and item.is_integer():
                    values[name] = int(item)
            except json.JSONDecodeError:
                raise ValueError(f"{name}: not JSON") from None
            except (TypeError, ValueError):
                raise ValueError(f"{name}: not of its type") from None
        try:
            return cls(**values)
        except ValidationError as exc:
            errors = exc.errors()
            wrong = [e for e in errors if e["type"] != "missing"]
            if wrong:
                raise ValueError(f"{wrong[0]['loc'][0]}: {wrong[0]['msg'][:120]}") from None
            raise ValueError(f"{', '.join(str(e['loc'][0]) for e in errors)}: missing") from None


def iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z") if value is not None else None
