"""Splits, shadows and hedging: the rows behind ``[routing.splits]``,
``[routing.shadows]`` and ``[routing.hedging]`` (routing.core.traffic)."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from routing.core.aliases import is_alias_pattern
from routing.core.traffic import (
    HEDGE_AFTER_FIXED,
    HEDGE_AFTER_MS_LIMIT,
    HEDGE_AFTER_P95,
    HEDGE_EXTRA_LIMIT,
    STICKY_KEY,
    STICKY_REQUEST,
    WEIGHT_LIMIT,
    HedgePolicy,
    ShadowPolicy,
    Split,
    SplitSide,
)

KEEP_LIMIT = 1000
ANSWER_CHARS_LIMIT = 262_144
SHADOW_TIMEOUT_LIMIT = 600.0


def _model_name_problem(name: str) -> str | None:
    if is_alias_pattern(name):
        return f"'{name}' is a pattern; name one model."
    return None


class TrafficSplit(models.Model):
    """A client-facing model name shared over several models by weight."""

    name = models.CharField(
        max_length=200,
        unique=True,
        help_text="The name clients ask for, e.g. chat (not an alias; it wins "
        "over a model of the same name).",
    )
    sticky = models.CharField(
        max_length=8,
        choices=[
            (STICKY_KEY, "Key (a client key always lands on the same side)"),
            (STICKY_REQUEST, "Request (each request draws a side)"),
        ],
        default=STICKY_KEY,
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ("name",)
        verbose_name = "split"

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        super().clean()
        self.name = self.name.strip()
        if not self.name:
            return
        if (problem := _model_name_problem(self.name)) is not None:
            raise ValidationError({"name": problem})
        # routing.models imports this module (at its end) for its models.
        from routing.models import Alias

        if Alias.objects.filter(name=self.name).exists():
            raise ValidationError(
                {"name": f"'{self.name}' is an alias; a split needs a name of its own."}
            )

    @property
    def side_weights(self) -> dict[str, int]:
        return {target.model: target.weight for target in self.targets.all()}

    def set_targets(self, weights: dict[str, int]) -> None:
        """Replace the split's targets with these, validated, in this order."""
        self.targets.all().delete()
        for position, (model, weight) in enumerate(weights.items()):
            target = SplitTarget(
                split=self, position=position, model=model, weight=weight
            )
            target.full_clean()
            target.save()

    def as_split(self) -> Split:
        """The router core's split (raises ValueError if it is invalid)."""
        sides = tuple(
            SplitSide(target.model, target.weight) for target in self.targets.all()
        )
        return Split(self.name, sides, self.sticky)


class SplitTarget(models.Model):
    """One side of a split: a model and its weight."""

    split = models.ForeignKey(
        TrafficSplit, on_delete=models.CASCADE, related_name="targets"
    )
    position = models.PositiveIntegerField(default=0)
    model = models.CharField(max_length=200)
    weight = models.PositiveIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(WEIGHT_LIMIT)],
        help_text="Relative weight: 90 and 10 send 90 % and 10 %.",
    )

    class Meta:
        ordering = ("split", "position", "id")
        verbose_name = "split target"
        constraints = (
            models.UniqueConstraint(
                fields=("split", "model"), name="splittarget_model_once_per_split"
            ),
        )

    def __str__(self) -> str:
        return f"{self.model} ({self.weight})"

    def clean(self) -> None:
        super().clean()
        self.model = self.model.strip()
        if (problem := _model_name_problem(self.model)) is not None:
            raise ValidationError({"model": problem})
        try:
            split = self.split
        except TrafficSplit.DoesNotExist:
            return
        if self.model == split.name:
            raise ValidationError(
                {"model": f"Split '{split.name}' cannot target itself."}
            )
        if TrafficSplit.objects.filter(name=self.model).exists():
            raise ValidationError(
                {
                    "model": f"'{self.model}' is itself a split; splits are "
                    "single-level, so target a model or an alias."
                }
            )


class Shadow(models.Model):
    """Mirror a share of one model's requests to another, to compare answers."""

    model = models.CharField(
        max_length=200,
        unique=True,
        help_text="The model whose served requests are mirrored, e.g. llama3:8b.",
    )
    shadow_model = models.CharField(
        "shadow model",
        max_length=200,
        help_text="The model that answers the copies, e.g. qwen2.5:7b.",
    )
    percent = models.FloatField(
        default=5.0,
        validators=[MinValueValidator(0.0), MaxValueValidator(100.0)],
        help_text="Share of the model's requests mirrored (0 to 100).",
    )
    timeout_seconds = models.FloatField(
        "timeout (seconds)",
        default=30.0,
        validators=[MinValueValidator(0.1), MaxValueValidator(SHADOW_TIMEOUT_LIMIT)],
        help_text="A shadow answer slower than this is dropped.",
    )
    keep = models.PositiveIntegerField(
        "comparisons kept",
        default=50,
        validators=[MinValueValidator(1), MaxValueValidator(KEEP_LIMIT)],
        help_text="The newest comparisons kept; older ones are deleted.",
    )
    max_answer_chars = models.PositiveIntegerField(
        "answer size kept (characters)",
        default=16_384,
        validators=[MinValueValidator(256), MaxValueValidator(ANSWER_CHARS_LIMIT)],
        help_text="Each kept answer is cut to this many characters.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ("model",)
        verbose_name = "shadow"

    def __str__(self) -> str:
        return f"{self.model} ⇢ {self.shadow_model}"

    def clean(self) -> None:
        super().clean()
        self.model = self.model.strip()
        self.shadow_model = self.shadow_model.strip()
        for field in ("model", "shadow_model"):
            if (problem := _model_name_problem(getattr(self, field))) is not None:
                raise ValidationError({field: problem})
        if self.model and self.model == self.shadow_model:
            raise ValidationError({"shadow_model": "A model cannot shadow itself."})

    def as_policy(self) -> ShadowPolicy:
        return ShadowPolicy(
            model=self.model,
            shadow=self.shadow_model,
            percent=self.percent,
            timeout_seconds=self.timeout_seconds,
            keep=self.keep,
            max_answer_chars=self.max_answer_chars,
        )


# A shadow's settings, as the admin and the API edit them.
SHADOW_FIELDS = (
    "model",
    "shadow_model",
    "percent",
    "timeout_seconds",
    "keep",
    "max_answer_chars",
)


class ShadowComparison(models.Model):
    """One mirrored request: the client's answer and the shadow's, compared."""

    shadow = models.ForeignKey(
        Shadow, on_delete=models.CASCADE, related_name="comparisons"
    )
    request_id = models.CharField(max_length=128)
    created_at = models.DateTimeField(db_index=True)
    prompt = models.TextField(blank=True, default="")
    primary_model = models.CharField(max_length=200)
    primary_answer = models.TextField(blank=True, default="")
    primary_latency_ms = models.FloatField(default=0.0)
    primary_tokens = models.PositiveIntegerField(default=0)
    primary_finish = models.CharField(max_length=32, blank=True, default="")
    shadow_answer = models.TextField(blank=True, default="")
    shadow_latency_ms = models.FloatField(default=0.0)
    shadow_tokens = models.PositiveIntegerField(default=0)
    shadow_finish = models.CharField(max_length=32, blank=True, default="")
    shadow_error = models.CharField(max_length=200, blank=True, default="")
    similarity = models.FloatField(default=0.0, help_text="Text overlap, 0 to 1.")
    tools_match = models.BooleanField(null=True, blank=True)
    json_valid = models.BooleanField(null=True, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")
        verbose_name = "shadow comparison"

    def __str__(self) -> str:
        return f"{self.request_id} ({self.similarity:.2f})"


class Hedging(models.Model):
    """When one model's requests get a second attempt at another backend."""

    model = models.CharField(max_length=200, unique=True)
    after = models.CharField(
        max_length=8,
        choices=[
            (HEDGE_AFTER_FIXED, "A fixed delay (after ms)"),
            (HEDGE_AFTER_P95, "The model's observed p95 time to first byte"),
        ],
        default=HEDGE_AFTER_FIXED,
    )
    after_ms = models.PositiveIntegerField(
        "after (ms)",
        default=250,
        validators=[MaxValueValidator(HEDGE_AFTER_MS_LIMIT)],
        help_text="The delay; with p95, the delay until the p95 is known.",
    )
    max_extra = models.PositiveSmallIntegerField(
        "extra attempts",
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(HEDGE_EXTRA_LIMIT)],
    )
    max_body_bytes = models.PositiveIntegerField(
        "largest body hedged (bytes)",
        default=65_536,
        help_text="Larger requests are never hedged.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ("model",)
        verbose_name = "hedging"
        verbose_name_plural = "hedging"

    def __str__(self) -> str:
        return self.model

    def clean(self) -> None:
        super().clean()
        self.model = self.model.strip()
        if (problem := _model_name_problem(self.model)) is not None:
            raise ValidationError({"model": problem})

    def as_policy(self) -> HedgePolicy:
        return HedgePolicy(
            model=self.model,
            after=self.after,
            after_ms=self.after_ms,
            max_extra=self.max_extra,
            max_body_bytes=self.max_body_bytes,
        )
