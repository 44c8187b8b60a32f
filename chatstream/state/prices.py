"""What a model costs (docs/callers.md, "Prices and money", which works out a cost and what a request
reserves): USD per million tokens for input, cached input and output, as the admin sets them (at
most 6 decimal places), kept exactly as integers of pico-dollars per token, so that every cost is an
integer and every sum exact (``Price.cost``, ``Price.most``).

A price row that holds no price (a hand edit in Storage Explorer, a bad write: a field missing, an
amount that is not a whole number of pico-USD) costs only its own model: ``Prices.unreadable`` names
it, and its requests are refused until an admin sets its price again."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass

from .port import Unreadable
from .stored import Stored

PICO = 10**12  # pico-dollars per USD
MAX_PRICE = Decimal(100_000)  # USD per million tokens
PER_TOKEN = PICO // 10**6  # pico-dollars per token for 1 USD per million tokens


def usd(pico: int | None) -> float | None:
    """Pico-dollars as USD for an answer (exact: budgets and prices have at most 6 decimals)."""
    return None if pico is None else float(Decimal(pico) / PICO)


def usd_amount(value: object, maximum: Decimal) -> Decimal:
    """A USD amount (a JSON number) as a decimal; ValueError why it is not one."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number")
    amount = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    if not amount.is_finite() or amount < 0:
        raise ValueError("must be a non-negative number")
    if amount > maximum:
        raise ValueError(f"must be at most {maximum}")
    exponent = amount.normalize().as_tuple().exponent
    if isinstance(exponent, int) and exponent < -6:
        raise ValueError("has more than 6 decimal places")
    return amount


@dataclass(frozen=True, kw_only=True)
class Price(Stored):
    model: str
    input: NonNegativeInt  # pico-USD per token
    cached_input: NonNegativeInt
    output: NonNegativeInt
    updated_at: datetime

    def cost(self, prompt: int, cached: int, completion: int) -> int:
        """The cost in pico-USD of this usage (``cached`` is part of ``prompt``)."""
        cached = min(max(cached, 0), max(prompt, 0))
        return (max(prompt, 0) - cached) * self.input + cached * self.cached_input + max(completion, 0) * self.output

    def most(self, prompt: int, completion: int) -> int:
        """The most ``prompt`` and ``completion`` tokens may cost: what a request reserves."""
        return max(prompt, 0) * max(self.input, self.cached_input) + max(completion, 0) * self.output


class Prices(dict[str, Price]):
    """Every model's price, by model (a model without one is not in it), as one read of the price
    rows found them; ``unreadable``: the models whose row holds no price."""

    def __init__(self, found: Sequence[Price | Unreadable] = ()):
        super().__init__((price.model, price) for price in found if isinstance(price, Price))
        self.unreadable = frozenset(row.name for row in found if isinstance(row, Unreadable))


class PriceSpec(BaseModel):
    """A price as an admin sets it: USD per million tokens; ``cached_input`` defaults to ``input``."""

    model_config = ConfigDict(extra="forbid")

    input: Any
    output: Any
    cached_input: Any = None

    @field_validator("input", "output", "cached_input")
    @classmethod
    def _amount(cls, value: object, info: ValidationInfo) -> Decimal | None:
        if value is None and info.field_name == "cached_input":
            return None  # the input price (null is not a price: "must be a number")
        return usd_amount(value, MAX_PRICE)

    def price(self, model: str, now: datetime) -> Price:
        cached = self.cached_input if self.cached_input is not None else self.input
        return Price(
            model=model,
            input=int(self.input * PER_TOKEN),
            cached_input=int(cached * PER_TOKEN),
            output=int(self.output * PER_TOKEN),
            updated_at=now,
        )
