"""What models cost: per-model prices, and the nano-USD that costs are counted in.

``ModelPrice`` gives a model (or a glob pattern of models) a price per million
input and output tokens in USD, and optionally for input tokens read from and
written to a prompt cache; ``nanos_to_usd`` turns a counted cost back into
USD for reports.
"""

from __future__ import annotations

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from nexus_lib.model_patterns import is_valid_pattern


class ModelPrice(models.Model):
    """What a model costs per million tokens, in and out (USD).

    Cached input (read from a prompt cache) and cache writes have prices of
    their own when set; otherwise they cost the input price.

    ``model`` is a served model's name or a glob pattern (``llama3:*``); an
    exact name wins over patterns, and the longest matching pattern over
    shorter ones. A local model may have a price too, to charge teams for GPU
    time. Costs are counted in nano-USD, so prices have at most 3 decimals.
    """

    model = models.CharField(
        max_length=200, unique=True, help_text="Model name or glob pattern."
    )
    input_per_million = models.DecimalField(
        "input (USD per 1M tokens)",
        max_digits=12,
        decimal_places=3,
        default=Decimal(0),
        validators=[MinValueValidator(Decimal(0))],
    )
    output_per_million = models.DecimalField(
        "output (USD per 1M tokens)",
        max_digits=12,
        decimal_places=3,
        default=Decimal(0),
        validators=[MinValueValidator(Decimal(0))],
    )
    cached_input_per_million = models.DecimalField(
        "cached input (USD per 1M tokens)",
        max_digits=12,
        decimal_places=3,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal(0))],
        help_text="Input tokens read from a prompt cache (OpenAI's cached_tokens, "
        "Anthropic's cache reads). Empty: the input price.",
    )
    cache_write_per_million = models.DecimalField(
        "cache write (USD per 1M tokens)",
        max_digits=12,
        decimal_places=3,
        null=True,
        blank=True,
        validators=[MinValueValidator(Decimal(0))],
        help_text="Input tokens written to a prompt cache (Anthropic's cache "
        "creation). Empty: the input price.",
    )
    cache_hit_per_million = models.DecimalField(
        "cache hit (USD per 1M tokens)",
        max_digits=12,
        decimal_places=3,
        default=Decimal(0),
        validators=[MinValueValidator(Decimal(0))],
        help_text="What an answer from the response cache costs, per million "
        "of its tokens (0: free).",
    )
    batch_price_factor = models.DecimalField(
        "batch price factor",
        max_digits=5,
        decimal_places=3,
        default=Decimal(1),
        validators=[MinValueValidator(Decimal(0)), MaxValueValidator(Decimal(10))],
        help_text="What a batch job's line costs, as a fraction of these prices "
        "(0.5: half price; 1: the same).",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ("model",)
        verbose_name = "model price"

    def __str__(self) -> str:
        return (
            f"{self.model}: ${self.input_per_million} in / "
            f"${self.output_per_million} out per 1M tokens"
        )

    def clean(self) -> None:
        if not is_valid_pattern(self.model):
            raise ValidationError({"model": "Not a model name or glob pattern."})

    @property
    def input_nanos(self) -> int:
        """Nano-USD per input token ($X per 1M tokens is X*1000 nano-USD each)."""
        return int(self.input_per_million * 1000)

    @property
    def output_nanos(self) -> int:
        return int(self.output_per_million * 1000)

    @property
    def cached_input_nanos(self) -> int | None:
        """Nano-USD per cached input token (None: the input price)."""
        return _nanos(self.cached_input_per_million)

    @property
    def cache_write_nanos(self) -> int | None:
        """Nano-USD per input token written to a cache (None: the input price)."""
        return _nanos(self.cache_write_per_million)

    @property
    def cache_hit_nanos(self) -> int:
        return int(self.cache_hit_per_million * 1000)


def _nanos(per_million: Decimal | None) -> int | None:
    return None if per_million is None else int(per_million * 1000)


def nanos_to_usd(nanos: int | None) -> Decimal:
    """Nano-USD as USD (a Decimal with 9 places, exact)."""
    return Decimal(nanos or 0).scaleb(-9)
