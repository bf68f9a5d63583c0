"""Routing configuration: aliases, fallback chains and the routing policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import BaseConstraint, CheckConstraint, F, Q
from django.db.models.lookups import Exact
from django.utils import timezone

from routing.admission import AdmissionSettings, FlowKey, Sizing, StockUnit
from routing.core import FLEET_SETTINGS, FleetPolicy, Strategy
from routing.core.aliases import check_alias_pattern, is_alias_pattern
from routing.core.cache_policy import (
    ENTRY_BYTES_LIMIT,
    SCOPE_KEY,
    SCOPE_SHARED,
    TTL_LIMIT,
    CachePolicy,
    purge_times,
)
from routing.core.context_shift_policy import (
    KEEP_LAST_LIMIT,
    ContextShiftPolicy,
)
from routing.core.context_shift_policy import RETRIES_LIMIT as CONTEXT_RETRIES_LIMIT
from routing.core.ensemble_policy import (
    CRITIQUE_REQUIRED,
    OPINIONS_LIMIT,
    REFINE_REQUIRED,
    TIMEOUT_LIMIT,
    EnsemblePolicy,
    prompt_problem,
)
from routing.core.fleet_policy import SETTINGS_BY_NAME
from routing.core.prefix_policy import (
    BLOCK_CHARS_RANGE,
    CACHE_BLOCKS_RANGE,
    DEFAULT_SESSION_KEYS,
    IMBALANCE_LIMIT,
    RATIO_LIMIT,
    SESSION_KEYS_LIMIT,
    SESSION_TTL_LIMIT,
    PrefixPolicy,
    prefix_problem,
)


class Alias(models.Model):
    """A public model name that routes to another model (single level).

    A name with ``*`` or ``?`` is a pattern (``claude-*``): it covers every
    name that no enabled backend serves and no exact alias names, the longest
    pattern first (routing.core.aliases).
    """

    name = models.CharField(
        max_length=200, unique=True, help_text="The name clients ask for, e.g. gpt-4."
    )
    target = models.CharField(
        max_length=200, help_text="The model served instead, e.g. llama3:70b."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ("name",)
        verbose_name_plural = "aliases"
        constraints = (
            models.CheckConstraint(
                condition=~Q(name=F("target")), name="alias_not_self"
            ),
        )

    def __str__(self) -> str:
        return f"{self.name} → {self.target}"

    @property
    def is_pattern(self) -> bool:
        """Whether the name is a pattern (has ``*`` or ``?``)."""
        return is_alias_pattern(self.name)

    def clean(self) -> None:
        super().clean()
        self.name = self.name.strip()
        self.target = self.target.strip()
        if not self.name or not self.target:
            return  # field validation reports blanks
        if self.name == self.target:
            raise ValidationError(
                {"target": f"Alias '{self.name}' cannot target itself."}
            )
        if self.is_pattern and (why := check_alias_pattern(self.name)) is not None:
            raise ValidationError({"name": why})
        if is_alias_pattern(self.target):
            raise ValidationError(
                {
                    "target": f"'{self.target}' is a pattern; the target must be "
                    "the one model name to serve instead."
                }
            )
        others = Alias.objects.exclude(pk=self.pk)
        if others.filter(name=self.target).exists():
            raise ValidationError(
                {
                    "target": f"'{self.target}' is itself an alias; aliases are "
                    "single-level, so target a model name instead."
                }
            )
        pointing_here = others.filter(target=self.name).values_list("name", flat=True)
        if pointing_here:
            raise ValidationError(
                {
                    "name": f"Alias '{pointing_here[0]}' already targets "
                    f"'{self.name}'; aliases are single-level, so '{self.name}' "
                    "cannot become an alias too."
                }
            )
        if ChainStep.objects.filter(model=self.name, chain__model=self.target).exists():
            raise ValidationError(
                {
                    "target": f"The fallback chain of '{self.target}' lists "
                    f"'{self.name}'; an alias from it back to '{self.target}' "
                    "would make the chain a cycle."
                }
            )


class FallbackChain(models.Model):
    """Models to try, in order, when a model has no backend that can serve it."""

    model = models.CharField(
        max_length=200,
        unique=True,
        help_text="The primary model (or alias) this chain applies to.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ("model",)

    def __str__(self) -> str:
        return self.model

    def clean(self) -> None:
        super().clean()
        self.model = self.model.strip()

    @property
    def fallback_models(self) -> list[str]:
        return [step.model for step in self.steps.all()]

    def set_fallbacks(self, models_in_order: list[str]) -> None:
        """Replace the chain's steps with the given models, validated, in order."""
        self.steps.all().delete()
        for position, name in enumerate(models_in_order):
            step = ChainStep(chain=self, position=position, model=name)
            step.full_clean()
            step.save()


class ChainStep(models.Model):
    """One fallback model in a chain; lower positions are tried first."""

    chain = models.ForeignKey(
        FallbackChain, on_delete=models.CASCADE, related_name="steps"
    )
    position = models.PositiveIntegerField(default=0)
    model = models.CharField(max_length=200)

    class Meta:
        ordering = ("chain", "position", "id")
        verbose_name = "fallback"
        constraints = (
            models.UniqueConstraint(
                fields=("chain", "model"), name="chainstep_model_once_per_chain"
            ),
        )

    def __str__(self) -> str:
        return self.model

    def clean(self) -> None:
        super().clean()
        self.model = self.model.strip()
        try:
            chain = self.chain
        except FallbackChain.DoesNotExist:
            return  # field validation reports the missing chain
        if self.model == chain.model:
            raise ValidationError(
                {"model": f"'{self.model}' cannot be a fallback for itself."}
            )
        if is_alias_pattern(self.model):
            raise ValidationError(
                {
                    "model": f"'{self.model}' is a pattern; a fallback is one model "
                    "name (or alias)."
                }
            )
        # An alias step is resolved one level, like a requested model: one that
        # leads back to the chain's own model would be a cycle.
        target = (
            Alias.objects.filter(name=self.model).values_list("target", flat=True)
        ).first()
        if target is not None and target == chain.model:
            raise ValidationError(
                {
                    "model": f"'{self.model}' is an alias for '{target}', the model "
                    "this chain is for; a fallback must lead elsewhere."
                }
            )


WEIGHTS_CONSTRAINT = "routingpolicy_weights_sum_100"


# The admin's words for the router core's strategies (routing.core.Strategy is
# the one list of them).
STRATEGY_LABELS: dict[Strategy, str] = {
    Strategy.SMART: "Smart (priority, load, latency)",
    Strategy.ROUND_ROBIN: "Round robin",
    Strategy.PRIORITY_ONLY: "Priority only",
    Strategy.RANDOM: "Random",
    Strategy.FLEET: "Fleet (loaded models, memory, queues)",
}


def fleet_field(name: str) -> models.Field[Any, Any]:
    """The policy field of one fleet setting, with its default and range."""
    setting = SETTINGS_BY_NAME[name]
    validators = [MinValueValidator(setting.low), MaxValueValidator(setting.high)]
    label = name.replace("_", " ")
    if setting.kind is int:
        return models.PositiveIntegerField(
            label,
            default=setting.default,
            validators=validators,
            help_text=setting.label,
        )
    return models.FloatField(
        label,
        default=setting.default,
        null=setting.default is None,
        blank=setting.default is None,
        validators=validators,
        help_text=setting.label[:1].upper() + setting.label[1:] + ".",
    )


# The admission settings stored as ``admission_<name>`` fields that cannot be
# empty (the two optional bounds are handled beside them).
ADMISSION_FIELDS = (
    "enabled",
    "flow_key",
    "sizing",
    "default_output_tokens",
    "total_capacity",
    "flow_capacity",
    "critical_reserved",
    "queue_ttl",
    "watermark_per_backend",
    "percentage_deviation_for_bounds",
    "model_weights",
    "model_output_tokens",
    "critical_share",
    "default_share",
    "sheddable_share",
    "stock_unit",
)


def _critique_prompt_validator(value: str) -> None:
    problem = prompt_problem("The critique prompt", value, CRITIQUE_REQUIRED)
    if problem is not None:
        raise ValidationError(problem + ".")


def _session_keys_validator(value: str) -> None:
    problem = prefix_problem(256, 0, 0.0, 1, value, 1.0)
    if problem is not None:
        raise ValidationError(problem.replace("session_keys", "The session keys") + ".")


def _refine_prompt_validator(value: str) -> None:
    problem = prompt_problem("The refine prompt", value, REFINE_REQUIRED)
    if problem is not None:
        raise ValidationError(problem + ".")


class RoutingPolicy(models.Model):
    """The single, global routing policy (strategy, scoring weights, retries)."""

    SINGLETON_PK = 1

    id = models.PositiveSmallIntegerField(primary_key=True, default=SINGLETON_PK)
    strategy = models.CharField(
        max_length=16,
        choices=[(strategy.value, STRATEGY_LABELS[strategy]) for strategy in Strategy],
        default=Strategy.SMART,
    )
    weight_priority = models.PositiveSmallIntegerField(
        "priority weight", default=50, validators=[MaxValueValidator(100)]
    )
    weight_load = models.PositiveSmallIntegerField(
        "load weight", default=30, validators=[MaxValueValidator(100)]
    )
    weight_latency = models.PositiveSmallIntegerField(
        "latency weight", default=20, validators=[MaxValueValidator(100)]
    )
    max_retries = models.PositiveSmallIntegerField(
        default=2,
        validators=[MaxValueValidator(10)],
        help_text="Other backends to try when one fails before answering.",
    )
    admission_enabled = models.BooleanField(
        "admission control",
        default=True,
        help_text="Queue requests in Nexus, fairly per flow, when backends are busy.",
    )
    admission_flow_key = models.CharField(
        "flow",
        max_length=16,
        choices=[
            (FlowKey.KEY.value, "Client key (per tenant)"),
            (FlowKey.MODEL.value, "Model"),
            (FlowKey.KEY_MODEL.value, "Client key and model"),
        ],
        default=FlowKey.KEY,
        help_text="What shares the backends fairly.",
    )
    admission_sizing = models.CharField(
        "request size",
        max_length=8,
        choices=[
            (Sizing.TOKENS.value, "Estimated tokens (prompt + max_tokens)"),
            (Sizing.FIXED.value, "Fixed (every request counts 1)"),
        ],
        default=Sizing.TOKENS,
    )
    admission_default_output_tokens = models.PositiveIntegerField(
        "default output tokens",
        default=256,
        validators=[MaxValueValidator(10_000_000)],
        help_text="A request's output size when it sets no max_tokens.",
    )
    admission_total_capacity = models.PositiveIntegerField(
        "total capacity",
        default=1000,
        validators=[MinValueValidator(1), MaxValueValidator(1_000_000)],
        help_text="Requests that may wait in the whole gateway (every model, every serving process).",
    )
    admission_flow_capacity = models.PositiveIntegerField(
        "flow capacity",
        default=100,
        validators=[MinValueValidator(1), MaxValueValidator(1_000_000)],
        help_text="Requests one flow may have waiting in the whole gateway.",
    )
    admission_critical_reserved = models.PositiveIntegerField(
        "places reserved for critical requests",
        default=100,
        validators=[MaxValueValidator(1_000_000)],
    )
    admission_queue_ttl = models.FloatField(
        "queue TTL",
        default=30.0,
        help_text="Seconds a request may wait before it gets a 503.",
    )
    admission_watermark_per_backend = models.FloatField(
        "watermark per backend",
        default=4.0,
        help_text="Requests in flight per ready backend that the queue aims at "
        "(a backend with a max concurrency uses that instead).",
    )
    admission_percentage_deviation_for_bounds = models.FloatField(
        "band deviation",
        default=0.1,
        help_text="The band is the watermark ± this fraction (between 0 and 1).",
    )
    admission_lower_bound_per_backend = models.FloatField(
        "lower bound per backend",
        null=True,
        blank=True,
        help_text="Overrides the band's lower bound: waiting requests are sent "
        "while the stock is below it.",
    )
    admission_upper_bound_per_backend = models.FloatField(
        "upper bound per backend",
        null=True,
        blank=True,
        help_text="Overrides the band's upper bound: requests go straight through "
        "while the stock is below it and none wait.",
    )
    admission_model_weights = models.JSONField(
        "model weights",
        default=dict,
        blank=True,
        help_text='Weights of models in the fair queue, e.g. {"llama3:70b": 2}; '
        "others weigh 1.",
    )
    admission_model_output_tokens = models.JSONField(
        "output tokens per model",
        default=dict,
        blank=True,
        help_text="A request's output size when it sets no max_tokens, for these "
        'models, e.g. {"llama3:70b": 1024}; others use the default output tokens.',
    )
    admission_critical_share = models.PositiveSmallIntegerField(
        "critical share",
        default=70,
        validators=[MaxValueValidator(100)],
        help_text="Share of the dispatches that critical requests get while other "
        "levels wait too (100 / 0 / 0: strict priority).",
    )
    admission_default_share = models.PositiveSmallIntegerField(
        "default share",
        default=25,
        validators=[MaxValueValidator(100)],
        help_text="Share of default requests (0: only when no level with a share "
        "waits).",
    )
    admission_sheddable_share = models.PositiveSmallIntegerField(
        "sheddable share",
        default=5,
        validators=[MaxValueValidator(100)],
        help_text="Share of sheddable requests.",
    )
    admission_stock_unit = models.CharField(
        "stock unit",
        max_length=8,
        choices=[
            (StockUnit.REQUESTS.value, "Requests (each counts 1)"),
            (StockUnit.TOKENS.value, "Tokens (each counts its estimated size)"),
        ],
        default=StockUnit.REQUESTS,
        help_text="What the in-flight stock and the band count: with tokens, "
        "ten 8,000-token prompts fill the band that ten 50-token ones do not.",
    )
    admission_watermark_tokens_per_backend = models.FloatField(
        "token watermark per backend",
        null=True,
        blank=True,
        help_text="Tokens in flight aimed at per ready backend when the stock "
        "counts tokens (default: the watermark per backend x twice the default "
        "output tokens).",
    )
    # The fleet strategy's settings (routing.core.fleet_policy.FLEET_SETTINGS).
    hot_points = fleet_field("hot_points")
    warm_points = fleet_field("warm_points")
    on_disk_points = fleet_field("on_disk_points")
    warm_window_seconds = fleet_field("warm_window_seconds")
    served_hot_seconds = fleet_field("served_hot_seconds")
    fit_over_2_points = fleet_field("fit_over_2_points")
    fit_over_1_5_points = fleet_field("fit_over_1_5_points")
    fit_over_1_2_points = fleet_field("fit_over_1_2_points")
    fit_over_1_points = fleet_field("fit_over_1_points")
    queue_points_per_request = fleet_field("queue_points_per_request")
    queue_penalty_max = fleet_field("queue_penalty_max")
    wait_seconds_per_point = fleet_field("wait_seconds_per_point")
    wait_penalty_max = fleet_field("wait_penalty_max")
    affinity_max_points = fleet_field("affinity_max_points")
    trend_rising_points = fleet_field("trend_rising_points")
    trend_stable_points = fleet_field("trend_stable_points")
    trend_falling_points = fleet_field("trend_falling_points")
    context_fit_max_points = fleet_field("context_fit_max_points")
    pre_warm_threshold = fleet_field("pre_warm_threshold")
    rebalance_threshold = fleet_field("rebalance_threshold")
    rebalance_interval_seconds = fleet_field("rebalance_interval_seconds")
    rebalance_max_moves = fleet_field("rebalance_max_moves")
    hold_seconds = fleet_field("hold_seconds")
    fleet_queue_length = fleet_field("fleet_queue_length")
    fleet_queue_timeout_seconds = fleet_field("fleet_queue_timeout_seconds")
    # Context shift (routing.core.context_shift_policy).
    context_shift_enabled = models.BooleanField(
        "context shift",
        default=True,
        help_text="Trim a chat that overflows a model's context and resend it, "
        "rather than answer the server's context error.",
    )
    context_shift_keep_last_messages = models.PositiveSmallIntegerField(
        "keep last messages",
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(KEEP_LAST_LIMIT)],
        help_text="Newest non-system messages never dropped.",
    )
    context_shift_max_retries = models.PositiveSmallIntegerField(
        "context shift retries",
        default=2,
        validators=[MaxValueValidator(CONTEXT_RETRIES_LIMIT)],
        help_text="Trimmed resends to the backend that overflowed (the second "
        "drops the tool definitions too).",
    )
    # Multiple opinions, moe-<model> (routing.core.ensemble_policy).
    ensemble_opinions = models.PositiveSmallIntegerField(
        "opinions",
        default=3,
        validators=[MinValueValidator(1), MaxValueValidator(OPINIONS_LIMIT)],
        help_text="Backends asked for an answer to a moe-<model> request (fewer "
        "when fewer serve the model).",
    )
    ensemble_critique_prompt = models.TextField(
        "critique prompt",
        blank=True,
        default="",
        validators=[_critique_prompt_validator],
        help_text="Leave empty for the default. Must contain {answers}; may "
        "contain {question}. It should ask for lines 'Answer <n>: <score>/10'.",
    )
    ensemble_refine_prompt = models.TextField(
        "refine prompt",
        blank=True,
        default="",
        validators=[_refine_prompt_validator],
        help_text="Leave empty for the default. Must contain {answer}; may "
        "contain {question} and {critiques}.",
    )
    ensemble_step_timeout_seconds = models.FloatField(
        "step timeout (seconds)",
        default=120.0,
        validators=[MinValueValidator(1.0), MaxValueValidator(TIMEOUT_LIMIT)],
        help_text="Longest wait for each step (answers, critiques, the refined "
        "answer's start); a backend slower than that is left out.",
    )
    # Prompt caching ([cache] in the configuration file).
    cache_anthropic_auto_breakpoints = models.BooleanField(
        "automatic Anthropic cache breakpoints",
        default=False,
        help_text="Mark the system prompt and the tool list of requests to "
        "Anthropic backends for prompt caching when the client marked nothing "
        "(Claude Code and Claude Desktop never do).",
    )
    # Prefix-aware routing and session affinity (routing.core.prefix_policy).
    prefix_enabled = models.BooleanField(
        "prefix-aware routing",
        default=False,
        help_text="Send a request whose prompt starts like a recent one to the "
        "backend that computed it (its prompt cache), and a session to its "
        "backend, within the load guard.",
    )
    prefix_block_chars = models.PositiveIntegerField(
        "block size (characters)",
        default=256,
        validators=[
            MinValueValidator(BLOCK_CHARS_RANGE[0]),
            MaxValueValidator(BLOCK_CHARS_RANGE[1]),
        ],
        help_text="Prompts are matched in blocks of this many characters.",
    )
    prefix_max_imbalance = models.PositiveIntegerField(
        "load guard (requests)",
        default=4,
        validators=[MaxValueValidator(IMBALANCE_LIMIT)],
        help_text="A prefix's or session's backend is skipped when its load "
        "exceeds the least-loaded candidate's by more than this many requests "
        "(or the ratio below, whichever is larger).",
    )
    prefix_max_imbalance_ratio = models.FloatField(
        "load guard (ratio)",
        default=0.5,
        validators=[MinValueValidator(0.0), MaxValueValidator(RATIO_LIMIT)],
        help_text="The same guard as a share of the least-loaded candidate's "
        "load (0.5: 50 % more).",
    )
    prefix_cache_blocks = models.PositiveIntegerField(
        "cache size (blocks)",
        default=4096,
        validators=[
            MinValueValidator(CACHE_BLOCKS_RANGE[0]),
            MaxValueValidator(CACHE_BLOCKS_RANGE[1]),
        ],
        help_text="Blocks a backend's prompt cache is thought to hold, per "
        "model, unless the backend sets its prefix cache tokens.",
    )
    prefix_session_keys = models.CharField(
        "session keys",
        max_length=SESSION_KEYS_LIMIT,
        blank=True,
        default=DEFAULT_SESSION_KEYS,
        validators=[_session_keys_validator],
        help_text="Comma-separated headers (x-...) and body fields (user, "
        "metadata.user_id) naming a session; the first one present counts.",
    )
    prefix_session_ttl_seconds = models.FloatField(
        "session time to live (seconds)",
        default=600.0,
        validators=[MinValueValidator(0.001), MaxValueValidator(SESSION_TTL_LIMIT)],
        help_text="How long a session sticks to its backend after its last request.",
    )
    # The exact response cache (routing.core.cache_policy, gateway/cache/).
    cache_enabled = models.BooleanField(
        "response cache",
        default=False,
        help_text="Answer a repeated request from the cache instead of a backend.",
    )
    cache_ttl_seconds = models.PositiveIntegerField(
        "cache TTL (seconds)",
        default=3600,
        validators=[MinValueValidator(1), MaxValueValidator(TTL_LIMIT)],
        help_text="How long a stored answer is served (a request's "
        "x-nexus-cache-ttl header may ask for another).",
    )
    cache_scope = models.CharField(
        "cache scope",
        max_length=8,
        choices=[
            (SCOPE_KEY, "Key (each client key sees its own answers)"),
            (SCOPE_SHARED, "Shared (every key uses every answer)"),
        ],
        default=SCOPE_KEY,
    )
    cache_max_entry_bytes = models.PositiveIntegerField(
        "cache max entry (bytes)",
        default=1024 * 1024,
        validators=[MinValueValidator(1), MaxValueValidator(ENTRY_BYTES_LIMIT)],
        help_text="Answers larger than this are not stored.",
    )
    cache_only_deterministic = models.BooleanField(
        "cache deterministic requests only",
        default=True,
        help_text="Cache only requests with temperature 0, a seed, or the "
        "header 'x-nexus-cache: on'.",
    )
    # Purges (routing.cache_purge): {"all": time, "models": {name: time},
    # "keys": {prefix: time}}; an entry stored before one that covers it is
    # not served, in every serving process.
    cache_purges = models.JSONField(default=dict, blank=True, editable=False)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "routing policy"
        verbose_name_plural = "routing policy"
        constraints = (
            models.CheckConstraint(condition=Q(id=1), name="routingpolicy_singleton"),
            models.CheckConstraint(
                condition=Q(strategy__in=[strategy.value for strategy in Strategy]),
                name="routingpolicy_strategy_valid",
            ),
            models.CheckConstraint(
                condition=Exact(
                    F("weight_priority") + F("weight_load") + F("weight_latency"), 100
                ),
                name=WEIGHTS_CONSTRAINT,
            ),
            models.CheckConstraint(
                condition=Q(max_retries__lte=10), name="routingpolicy_max_retries"
            ),
        )

    def __str__(self) -> str:
        return "Routing policy"

    def save(self, *args: object, **kwargs: object) -> None:
        self.pk = self.SINGLETON_PK
        super().save(*args, **kwargs)  # type: ignore[arg-type]

    def get_constraints(
        self,
    ) -> list[tuple[type[models.Model], Sequence[BaseConstraint]]]:
        # Each check constraint is the database's backstop for a rule checked
        # before it with clearer words: the singleton's id by save(), the
        # strategy by the field's choices, the retries by its validator, and the
        # weights' sum by clean() (which names the actual sum). Validating them
        # again would cost a query each on every save from the admin and the
        # API, and repeat an error in Django's generic words.
        return [
            (model, [c for c in constraints if not isinstance(c, CheckConstraint)])
            for model, constraints in super().get_constraints()
        ]

    def clean(self) -> None:
        super().clean()
        weights = (self.weight_priority, self.weight_load, self.weight_latency)
        if None not in weights and sum(weights) != 100:
            raise ValidationError(
                "The priority, load and latency weights must sum to 100 "
                f"(they sum to {sum(weights)})."
            )
        problems = self.admission_problems()
        if problems:
            raise ValidationError(
                {f"admission_{name}": message for name, message in problems.items()}
            )

    def admission_problems(self) -> dict[str, str]:
        """What is wrong with the admission settings, by setting name."""
        weights = self.admission_model_weights
        if not _maps_names_to(weights, int | float):
            return {"model_weights": "must map model names to numbers"}
        if not _maps_names_to(self.admission_model_output_tokens, int):
            return {"model_output_tokens": "must map model names to whole numbers"}
        values = self._admission_values()
        required = (values[name] for name in ADMISSION_FIELDS)
        if None in required:
            return {}  # field validation reports the blanks
        return AdmissionSettings.check(**values)

    def admission_settings(self) -> AdmissionSettings:
        """The admission settings (raises ValueError if clean() would fail)."""
        return AdmissionSettings(**self._admission_values())

    def fleet_policy(self) -> FleetPolicy:
        """The fleet settings (raises ValueError if field validation would fail)."""
        return FleetPolicy(
            **{setting.name: getattr(self, setting.name) for setting in FLEET_SETTINGS}
        )

    def context_shift_policy(self) -> ContextShiftPolicy:
        """The context shift settings (raises ValueError if out of range)."""
        return ContextShiftPolicy(
            enabled=self.context_shift_enabled,
            keep_last_messages=self.context_shift_keep_last_messages,
            max_retries=self.context_shift_max_retries,
        )

    def ensemble_policy(self) -> EnsemblePolicy:
        """The multiple-opinions settings (raises ValueError if out of range)."""
        return EnsemblePolicy(
            opinions=self.ensemble_opinions,
            critique_prompt=self.ensemble_critique_prompt,
            refine_prompt=self.ensemble_refine_prompt,
            step_timeout_seconds=self.ensemble_step_timeout_seconds,
        )

    def prefix_policy(self) -> PrefixPolicy:
        """The prefix routing settings (raises ValueError if out of range)."""
        return PrefixPolicy(
            enabled=self.prefix_enabled,
            block_chars=self.prefix_block_chars,
            max_imbalance=self.prefix_max_imbalance,
            max_imbalance_ratio=self.prefix_max_imbalance_ratio,
            cache_blocks=self.prefix_cache_blocks,
            session_keys=self.prefix_session_keys,
            session_ttl_seconds=self.prefix_session_ttl_seconds,
        )

    def cache_policy(self) -> CachePolicy:
        """The response cache settings (raises ValueError if out of range)."""
        return CachePolicy(
            enabled=self.cache_enabled,
            ttl_seconds=self.cache_ttl_seconds,
            scope=self.cache_scope,
            max_entry_bytes=self.cache_max_entry_bytes,
            only_deterministic=self.cache_only_deterministic,
            **purge_times(self.cache_purges),
        )

    def _admission_values(self) -> dict[str, Any]:
        values = {name: getattr(self, f"admission_{name}") for name in ADMISSION_FIELDS}
        values["lower_bound_per_backend"] = self.admission_lower_bound_per_backend
        values["upper_bound_per_backend"] = self.admission_upper_bound_per_backend
        values["watermark_tokens_per_backend"] = (
            self.admission_watermark_tokens_per_backend
        )
        return values

    @classmethod
    def load(cls) -> RoutingPolicy:
        """Return the policy, creating it with defaults the first time."""
        policy, _ = cls.objects.get_or_create(pk=cls.SINGLETON_PK)
        return policy


def _maps_names_to(value: object, kind: Any) -> bool:
    """Whether `value` is a dict of model names to numbers of `kind`."""
    return isinstance(value, dict) and all(
        isinstance(name, str)
        and isinstance(number, kind)
        and not isinstance(number, bool)
        for name, number in value.items()
    )


class ConfigVersion(models.Model):
    """A counter bumped on every committed change to routing data.

    Serving processes compare it with the version of the snapshot they hold and
    rebuild when it moved, so a change reaches every process even when the
    broadcast that announces it is lost.
    """

    SINGLETON_PK = 1

    id = models.PositiveSmallIntegerField(primary_key=True, default=SINGLETON_PK)
    version = models.PositiveBigIntegerField(default=0)
    changed_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "configuration version"
        constraints = (
            models.CheckConstraint(condition=Q(id=1), name="configversion_singleton"),
        )

    def __str__(self) -> str:
        return f"Configuration version {self.version}"


class ConfigRevision(models.Model):
    """One version of the configuration history: who changed what, and when.

    ``snapshot`` is the canonical export (``nexus_export_config``) right after
    the change, so that any version can be restored through the import; it
    never holds a secret. ``secret_marks`` tells, per backend, whether its API
    key changed (a keyed fingerprint, never the key); ``diff`` is the
    structural difference from the version before (routing/history/diff.py).
    The API and the admin call these "versions"; ``ConfigVersion`` above is
    the serving processes' change counter.
    """

    number = models.PositiveIntegerField(unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    author = models.CharField(max_length=200)
    via = models.CharField(max_length=20)
    reverted_to = models.PositiveIntegerField(null=True, blank=True)
    snapshot = models.TextField()
    secret_marks = models.JSONField(default=dict)
    diff = models.JSONField(default=list)

    class Meta:
        ordering = ("-number",)
        verbose_name = "configuration version"
        permissions = (
            ("revert_configrevision", "Can revert the configuration to a version"),
        )

    def __str__(self) -> str:
        return f"Version {self.number}"
