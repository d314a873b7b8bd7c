"""Runtime settings of one proxy process (flags, not policy: policy comes from the CRs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..core.outcomes import DEFAULT_CAPACITY
from ..flow.answer_bounds import AnswerBounds
from ..flow.client_stream import KEEPALIVE_SECONDS
from ..flow.metrics import MAX_MACHINE_LABELS
from .credentials import DEFAULT_SECRETS_DIR
from .tracing import TraceSettings


@dataclass(frozen=True)
class ProxySettings:
    host: str = "127.0.0.1"
    port: int = 8080
    # With a port, /metrics, /healthz and /readyz are served there, on a listener of their
    # own with the API port's connection limits (health stays on the API port too).
    # `metrics_host` None: the API's host.
    metrics_port: int | None = None
    metrics_host: str | None = None
    # /metrics on the API port as well, to whoever reaches it. Off by default: the page
    # names every role, grant and provider, which a caller without a credential has no
    # business reading.
    metrics_on_api_port: bool = False
    max_body_bytes: int = 4 * 1024 * 1024
    # How much of an upstream's answer is read: its events, its size, its decompression.
    answer_bounds: AnswerBounds = field(default_factory=AnswerBounds)
    secrets_dir: Path = DEFAULT_SECRETS_DIR
    # How often API keys are re-read from the environment and mounted Secret files.
    key_refresh_seconds: float = 30.0
    # The client connections' limits (edge/connections.py): a request head must be complete
    # within `header_timeout_seconds` (of the connection's start, or of its first byte on a
    # kept-alive connection), a body within `body_timeout_seconds` of its head; a kept-alive
    # connection idle for `idle_timeout_seconds` is closed; one connection over
    # `max_connections` is answered 503 and closed. None limits a response.
    header_timeout_seconds: float = 10.0
    body_timeout_seconds: float = 30.0
    idle_timeout_seconds: float = 75.0
    max_connections: int = 4096
    # Streams still open at shutdown get this long to finish (SIGTERM drains).
    shutdown_grace_seconds: float = 30.0
    # Breaker reports on ProviderPolicy status are re-sent at least this often (in a
    # cluster); the operator expires a pod's report after three missed heartbeats.
    status_heartbeat_seconds: float = 30.0
    # Admits to the explanation endpoints and /v1/feedback as a bearer token (as does an
    # AccessGrant with admin: true); without either they are closed.
    admin_token: str | None = None
    # How long a ServiceAccount token's TokenReview verdict is trusted (edge/callers.py).
    token_cache_seconds: float = 60.0
    # The pod's memory (what it learned of each machine) kept in this file across
    # restarts, written every `state_save_seconds` and at shutdown; None: not kept.
    state_file: Path | None = None
    state_save_seconds: float = 30.0
    # In a cluster, how often the pod's memory is written to its ProxyMemory, shared with
    # the other pods (edge/fleet_memory.py); and once more at shutdown.
    memory_publish_seconds: float = 30.0
    # The outcome channel: its ring buffer, how long the drainer lets records gather
    # before handing a batch to the consumers (0: on the loop's next turn), and the
    # JSON-lines export target (a path, `-` for stdout, None: off).
    outcome_buffer: int = DEFAULT_CAPACITY
    outcome_batch_seconds: float = 0.0
    outcome_export: str | None = None
    # The operational score's shrinkage N and smoothing half-life (in observations).
    score_full_confidence: int = 50
    score_half_life: float = 35.0
    # The share of routing decisions in which a machine other than the best leads, so an
    # untried or demoted machine keeps being observed and can win its traffic back; a
    # role's own explorationShare overrides it.
    explore_share: float = 0.02
    # Seeds the proxy's randomness (backoff jitter, breaker cooldown jitter, the quality
    # tiers' dither) for reproducible simulations; None: seeded from the OS.
    random_seed: int | None = None
    # Machines an upstream names (an aggregator's sub-providers) that keep their own label
    # on the metrics, per provider; later ones share the label `other`. Configured
    # machines always keep theirs.
    metrics_max_machines: int = MAX_MACHINE_LABELS
    # A buffered stream (a role nobody watches) sends its caller an SSE comment this often
    # while the answer is held, so the caller's idle timers never fire.
    keepalive_seconds: float = KEEPALIVE_SECONDS
    # OpenTelemetry traces (edge/tracing.py: from the OTEL_* environment); None: off.
    tracing: TraceSettings | None = None
