"""`rolegate <subcommand>`: one command for every component; each imports its code lazily."""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from rolegate_cli.logs import LogFormat, configure_logging

REPORT_LOGGER = "rolegate.compile"
ALWAYS_SHOWN = (REPORT_LOGGER, "rolegate.proxy.started")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    # What the commands always said on stderr (the compile report, where the proxy
    # listens) shows at every level, now as log lines.
    for name in ALWAYS_SHOWN:
        logging.getLogger(name).setLevel(logging.INFO)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rolegate",
        description="A Kubernetes-native routing proxy for LLM traffic.",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="info adds the proxy's access log: one line per request (default: warning)",
    )
    parser.add_argument(
        "--log-format",
        type=LogFormat,
        default=LogFormat.TEXT,
        choices=list(LogFormat),
        help="json: one object per line with time, level, logger, message and the line's "
        "fields (request_id, role, provider, machine, outcome, ...) (default: text)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    proxy = commands.add_parser("proxy", help="serve the OpenAI-compatible routing proxy")
    origin = proxy.add_mutually_exclusive_group(required=True)
    origin.add_argument(
        "--manifests",
        type=Path,
        help="directory of RoleTable and ProviderPolicy YAML, compiled at start (standalone mode)",
    )
    origin.add_argument(
        "--configmap",
        metavar="NAMESPACE/NAME",
        help="watch this ConfigMap (written by `rolegate operator`) and reload on change",
    )
    proxy.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="with --configmap: kubeconfig to use (default: in-cluster, else $KUBECONFIG)",
    )
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8080)
    proxy.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve /metrics, /healthz and /readyz on this port, with --port's connection "
        "limits (health stays on --port as well); default: no /metrics at all",
    )
    proxy.add_argument(
        "--metrics-host",
        default=None,
        metavar="HOST",
        help="with --metrics-port: the address it listens on (default: the --host)",
    )
    proxy.add_argument(
        "--metrics-on-api-port",
        action="store_true",
        help="serve /metrics on --port too, to anyone who reaches it (it names every role, "
        "grant and provider); default: only on --metrics-port",
    )
    proxy.add_argument(
        "--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body"
    )
    proxy.add_argument(
        "--max-event-bytes",
        type=_positive_int,
        default=None,
        metavar="BYTES",
        help="largest event of an upstream's stream; a bigger one is that arm's fault "
        "(default: 4 MiB)",
    )
    proxy.add_argument(
        "--max-answer-bytes",
        type=_positive_int,
        default=None,
        metavar="BYTES",
        help="largest upstream answer, streamed or not, after decompression (default: 64 MiB)",
    )
    proxy.add_argument(
        "--max-decompression-ratio",
        type=_positive_float,
        default=None,
        metavar="RATIO",
        help="most an upstream answer past 1 MiB may decompress by (default: 200)",
    )
    proxy.add_argument(
        "--secrets-dir",
        type=Path,
        default=Path("/var/run/secrets/rolegate"),
        help="where Secret keys are mounted as <dir>/<secret name>/<key>",
    )
    proxy.add_argument(
        "--key-refresh-seconds",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="re-read the API keys (environment and Secret files) this often; a key found "
        "or lost shows on the ProviderPolicy's status at once (default: 30)",
    )
    proxy.add_argument(
        "--status-heartbeat-seconds",
        type=float,
        default=30.0,
        help="with --configmap: re-send this pod's report on each ProviderPolicy at least "
        "this often; a change is sent at once",
    )
    proxy.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="a file holding the admin token, which admits to /v1/rolegate/decisions, /state "
        "and /v1/feedback (as does an AccessGrant with admin: true; without either they are "
        "closed)",
    )
    proxy.add_argument(
        "--outcome-export",
        metavar="PATH",
        default=None,
        help="write one JSON line per finished request (routing metadata only) to PATH, "
        "or to stdout with '-' (default: off)",
    )
    proxy.add_argument(
        "--outcome-buffer",
        type=_positive_int,
        default=10_000,
        metavar="N",
        help="outcome records held for the consumers; when full the oldest are dropped "
        "and counted in rolegate_outcomes_dropped_total (default: 10000)",
    )
    proxy.add_argument(
        "--outcome-batch-seconds",
        type=_non_negative_float,
        default=0.0,
        metavar="S",
        help="let outcomes gather this long before the consumers take a batch (default: 0, "
        "on the event loop's next turn)",
    )
    proxy.add_argument(
        "--score-full-confidence",
        type=_positive_int,
        default=50,
        metavar="N",
        help="observations after which a machine's operational score is fully its own; "
        "fewer shrink it toward the mean of the machines it is ranked with (default: 50)",
    )
    proxy.add_argument(
        "--score-half-life",
        type=_positive_float,
        default=35.0,
        metavar="N",
        help="observations after which one observation weighs half in the smoothed score "
        "(default: 35)",
    )
    proxy.add_argument(
        "--shutdown-grace-seconds",
        type=_non_negative_float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, stop accepting requests and give open streams this long to finish "
        "(default: 30; keep the pod's terminationGracePeriodSeconds above it)",
    )
    proxy.add_argument(
        "--header-timeout-seconds",
        type=_positive_float,
        default=10.0,
        metavar="S",
        help="close a client connection whose request head is not complete this long after "
        "it opened (or after its first byte, on a kept-alive connection); a partial head "
        "gets a 408 (default: 10)",
    )
    proxy.add_argument(
        "--body-timeout-seconds",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="answer 408 and close when a request body is not complete this long after its "
        "head (default: 30)",
    )
    proxy.add_argument(
        "--idle-timeout-seconds",
        type=_positive_float,
        default=75.0,
        metavar="S",
        help="close a kept-alive client connection idle this long between requests; keep "
        "it above the idle timeout of a load balancer in front (default: 75)",
    )
    proxy.add_argument(
        "--state-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="keep what the proxy learned of each machine in this file: restored at start, "
        "written atomically every --state-save-seconds and at shutdown (default: not kept)",
    )
    proxy.add_argument(
        "--state-save-seconds",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="how often the --state-file is written (default: 30)",
    )
    proxy.add_argument(
        "--memory-publish-seconds",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="with --configmap: write what this pod learned of each machine to its "
        "ProxyMemory this often, for the other pods and its own restarts (default: 30)",
    )
    proxy.add_argument(
        "--token-cache-seconds",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="trust a ServiceAccount token's TokenReview verdict this long: a deleted "
        "account is refused at most this long after the API server stops accepting its "
        "token (default: 60)",
    )
    proxy.add_argument(
        "--max-connections",
        type=_positive_int,
        default=4096,
        metavar="N",
        help="client connections served at once; one more is answered 503 and closed "
        "(default: 4096; keep it under the process's open-file limit)",
    )
    proxy.add_argument(
        "--keepalive-seconds",
        type=_positive_float,
        default=5.0,
        metavar="S",
        help="for a role with Buffered delivery, send a streaming caller an SSE comment this "
        "often while its answer is held (default: 5)",
    )
    proxy.add_argument(
        "--explore-share",
        type=_share,
        default=0.02,
        metavar="P",
        help="share of routing decisions in which a machine other than the best leads, so "
        "an untried or demoted machine stays observed and can win its traffic back, for a "
        "role without an explorationShare of its own (default: 0.02)",
    )
    proxy.add_argument(
        "--metrics-max-machines",
        type=_non_negative_int,
        default=100,
        metavar="N",
        help="machines an upstream names (an aggregator's sub-providers) that keep their "
        "own label on /metrics, per provider; later ones share the label 'other', "
        "configured machines always keep theirs (default: 100)",
    )
    proxy.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed the proxy's randomness (jitter, the quality tiers' dither) for "
        "reproducible simulations (default: from the OS)",
    )
    proxy.set_defaults(handler=_run_proxy)

    operator = commands.add_parser(
        "operator",
        help="run the Kubernetes operator: RoleTables and ProviderPolicies into a ConfigMap",
    )
    watched = operator.add_mutually_exclusive_group(required=True)
    watched.add_argument(
        "--namespace",
        action="append",
        metavar="NS",
        help="watch RoleTables and ProviderPolicies in this namespace (repeatable)",
    )
    watched.add_argument(
        "--all-namespaces", action="store_true", help="watch them in every namespace"
    )
    operator.add_argument(
        "--configmap",
        default="rolegate-config",
        metavar="NAME",
        help="the ConfigMap the compiled configuration is written to (default: rolegate-config)",
    )
    operator.add_argument(
        "--configmap-namespace",
        metavar="NS",
        help="namespace of that ConfigMap (default: the first --namespace)",
    )
    operator.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="kubeconfig to use (default: in-cluster, else $KUBECONFIG or ~/.kube/config)",
    )
    operator.add_argument(
        "--liveness-port",
        type=int,
        metavar="PORT",
        help="serve kopf's liveness probe on http://0.0.0.0:PORT/healthz",
    )
    operator.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the operator's Prometheus metrics on http://0.0.0.0:PORT/metrics",
    )
    operator.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="elect one writer among replicas with a Lease in the ConfigMap's namespace "
        "(default: on; --no-leader-election for a single replica without the Lease)",
    )
    operator.add_argument(
        "--lease-name",
        default="rolegate-operator",
        metavar="NAME",
        help="the Lease the replicas elect their writer with (default: rolegate-operator)",
    )
    operator.add_argument(
        "--lease-seconds",
        type=float,
        default=15.0,
        metavar="S",
        help="a standby takes over once the leader has not renewed for this long (default: 15)",
    )
    operator.add_argument(
        "--lease-renew-deadline-seconds",
        type=float,
        default=10.0,
        metavar="S",
        help="a leader that cannot renew for this long stops writing (default: 10)",
    )
    operator.add_argument(
        "--lease-retry-seconds",
        type=float,
        default=2.0,
        metavar="S",
        help="how often the leader renews and a standby tries (default: 2)",
    )
    operator.add_argument(
        "--report-ttl-seconds",
        type=float,
        default=90.0,
        metavar="S",
        help="drop a proxy pod's breaker report not refreshed for this long (default: 90)",
    )
    operator.set_defaults(handler=_run_operator)

    sim = commands.add_parser("sim", help="serve the simulated OpenRouter-style provider")
    sim.add_argument("--scenario", type=Path, required=True, help="scenario YAML file")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8089)
    sim.set_defaults(handler=_run_sim)

    compile_ = commands.add_parser(
        "compile", help="compile a directory of manifests and print the configuration"
    )
    compile_.add_argument("directory", type=Path)
    compile_.add_argument(
        "--rulings",
        action="store_true",
        help=(
            "print one line per compiled role instead of the JSON, for diffing two versions: "
            "TABLE ROLE ruling=DECLARED->EFFECTIVE delivery=DECLARED->EFFECTIVE models=M1,M2 "
            "(the report stays on stderr)"
        ),
    )
    compile_.set_defaults(handler=_run_compile)

    dev_cluster = commands.add_parser(
        "dev-cluster",
        help="start a local etcd + kube-apiserver (built once from Go modules) to kubectl against",
    )
    dev_cluster.set_defaults(handler=_run_dev_cluster)

    demo = commands.add_parser(
        "demo", help="run the simulated provider and the proxy, with traffic"
    )
    demo.add_argument("--requests", type=int, default=60, help="how many requests to send")
    demo.add_argument(
        "--trace-file",
        type=Path,
        default=None,
        help="write every span (OpenTelemetry, as JSON lines) to this file and show one "
        "request's spans; needs the tracing extra",
    )
    demo.set_defaults(handler=_run_demo)
    return parser


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 0 to 65535, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _share(text: str) -> float:
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and under 1, got {text}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _run_proxy(args: argparse.Namespace) -> int:
    from rolegate_policy.config import (
        ProxyConfig,
    )
    from rolegate_proxy.edge.configmap_source import ConfigMapSource
    from rolegate_proxy.edge.server import CannotListen, serve
    from rolegate_proxy.edge.settings import ProxySettings
    from rolegate_proxy.edge.standalone import StandaloneConfigError, load_standalone_config
    from rolegate_proxy.edge.tracing import TracingUnavailable, from_environment
    from rolegate_proxy.flow.answer_bounds import AnswerBounds

    try:
        # OpenTelemetry traces: off unless the standard OTEL_* environment asks for them.
        tracing = from_environment(os.environ)
    except TracingUnavailable as error:
        print(f"rolegate proxy: {error}", file=sys.stderr)
        return 2
    source: ConfigMapSource | None = None
    if args.configmap is not None:
        namespace, _, name = args.configmap.partition("/")
        if not namespace or not name or "/" in name:
            print(
                f"rolegate proxy: --configmap takes NAMESPACE/NAME, got {args.configmap!r}",
                file=sys.stderr,
            )
            return 2
        source = ConfigMapSource(namespace=namespace, name=name, kubeconfig=args.kubeconfig)
        # Not ready until the first configuration arrives from the API server.
        config = ProxyConfig()
    else:
        # As JSON, the compile report is log lines like the rest of stderr.
        report = io.StringIO() if args.log_format is LogFormat.JSON else sys.stderr
        try:
            config = load_standalone_config(args.manifests, report)
        except StandaloneConfigError as error:
            _log_report(report)
            print(f"rolegate proxy: {error}", file=sys.stderr)
            return 2
        _log_report(report)
    if args.metrics_host is not None and args.metrics_port is None:
        print("rolegate proxy: --metrics-host needs --metrics-port", file=sys.stderr)
        return 2
    admin_token = None
    if args.admin_token_file is not None:
        try:
            admin_token = args.admin_token_file.read_text(encoding="utf-8").strip() or None
        except OSError as error:
            print(f"rolegate proxy: cannot read --admin-token-file: {error}", file=sys.stderr)
            return 2
    bounds = AnswerBounds()
    settings = ProxySettings(
        admin_token=admin_token,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        metrics_on_api_port=args.metrics_on_api_port,
        max_body_bytes=args.max_body_bytes,
        answer_bounds=AnswerBounds(
            max_event_bytes=args.max_event_bytes or bounds.max_event_bytes,
            max_answer_bytes=args.max_answer_bytes or bounds.max_answer_bytes,
            max_decompression_ratio=args.max_decompression_ratio or bounds.max_decompression_ratio,
        ),
        secrets_dir=args.secrets_dir,
        key_refresh_seconds=args.key_refresh_seconds,
        status_heartbeat_seconds=args.status_heartbeat_seconds,
        outcome_export=args.outcome_export,
        outcome_buffer=args.outcome_buffer,
        outcome_batch_seconds=args.outcome_batch_seconds,
        score_full_confidence=args.score_full_confidence,
        score_half_life=args.score_half_life,
        random_seed=args.seed,
        explore_share=args.explore_share,
        metrics_max_machines=args.metrics_max_machines,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        keepalive_seconds=args.keepalive_seconds,
        header_timeout_seconds=args.header_timeout_seconds,
        body_timeout_seconds=args.body_timeout_seconds,
        idle_timeout_seconds=args.idle_timeout_seconds,
        max_connections=args.max_connections,
        token_cache_seconds=args.token_cache_seconds,
        state_file=args.state_file,
        state_save_seconds=args.state_save_seconds,
        memory_publish_seconds=args.memory_publish_seconds,
        tracing=tracing,
    )
    try:
        serve(settings, config, source)
    except CannotListen as error:
        print(f"rolegate proxy: {error}", file=sys.stderr)
        return 2
    return 0


def _log_report(report: TextIO) -> None:
    if isinstance(report, io.StringIO):
        for line in filter(None, report.getvalue().splitlines()):
            logging.getLogger(REPORT_LOGGER).info("%s", line)


def _run_operator(args: argparse.Namespace) -> int:
    from kubernetes.config import ConfigException

    from rolegate_operator.controller import Options
    from rolegate_operator.kube import load_configuration
    from rolegate_operator.leader import ElectionOptions, replica_identity
    from rolegate_operator.lifecycle import exit_now
    from rolegate_operator.main import (
        CannotStart,
        Endpoints,
        KopfStopped,
        LoopCrashed,
        run_operator,
    )

    namespaces: tuple[str, ...] = tuple(dict.fromkeys(args.namespace or ()))
    configmap_namespace = args.configmap_namespace or (namespaces[0] if namespaces else None)
    if configmap_namespace is None:
        print(
            "rolegate operator: with --all-namespaces, say where the ConfigMap goes "
            "with --configmap-namespace",
            file=sys.stderr,
        )
        return 2
    options = Options(
        namespaces=namespaces,
        configmap_namespace=configmap_namespace,
        configmap_name=args.configmap,
        report_ttl_seconds=args.report_ttl_seconds,
    )
    election: ElectionOptions | None = None
    if args.leader_election:
        try:
            election = ElectionOptions(
                namespace=configmap_namespace,
                name=args.lease_name,
                identity=replica_identity(),
                lease_seconds=args.lease_seconds,
                renew_deadline_seconds=args.lease_renew_deadline_seconds,
                retry_seconds=args.lease_retry_seconds,
            )
        except ValueError as error:
            print(f"rolegate operator: {error}", file=sys.stderr)
            return 2
    try:
        configuration = load_configuration(
            str(args.kubeconfig) if args.kubeconfig is not None else None
        )
    except (ConfigException, OSError) as error:
        print(f"rolegate operator: no usable Kubernetes credentials: {error}", file=sys.stderr)
        return 2
    endpoints = Endpoints(
        liveness=(
            f"http://0.0.0.0:{args.liveness_port}/healthz"
            if args.liveness_port is not None
            else None
        ),
        metrics_port=args.metrics_port,
    )
    try:
        run_operator(options, configuration, endpoints=endpoints, election=election)
    except CannotStart as error:
        print(f"rolegate operator: {error}", file=sys.stderr)
        return 2
    except (LoopCrashed, KopfStopped) as error:
        print(f"rolegate operator: {error}", file=sys.stderr)
        exit_now(1)
    exit_now(0)


def _run_sim(args: argparse.Namespace) -> int:
    from rolegate_sim.scenario import ScenarioError
    from rolegate_sim.server import serve

    try:
        serve(args.scenario, args.host, args.port)
    except ScenarioError as error:
        print(f"rolegate sim: {error}", file=sys.stderr)
        return 2
    return 0


def _run_compile(args: argparse.Namespace) -> int:
    from rolegate_policy.compile import run_compile

    return run_compile(args.directory, sys.stdout, sys.stderr, rulings=args.rulings)


def _run_dev_cluster(args: argparse.Namespace) -> int:
    from rolegate_cli.controlplane import ControlPlaneError, run_dev_cluster

    try:
        return run_dev_cluster()
    except ControlPlaneError as error:
        print(f"rolegate dev-cluster: {error}", file=sys.stderr)
        return 1


def _run_demo(args: argparse.Namespace) -> int:
    try:
        from rolegate_cli.demo import run_demo
    except ModuleNotFoundError as error:
        if error.name != "openai":
            raise
        print(
            "rolegate demo: drives the proxy with the OpenAI client, which is an extra: "
            "pip install 'rolegate[demo]' (or run `make demo` from a clone).",
            file=sys.stderr,
        )
        return 2
    if args.trace_file is not None:
        try:
            import opentelemetry.sdk.trace  # noqa: F401 (only whether it is there)
        except ImportError:
            from rolegate_proxy.edge.tracing import INSTALL_HINT

            print(f"rolegate demo: --trace-file needs the OpenTelemetry SDK; {INSTALL_HINT}",
                  file=sys.stderr)  # fmt: skip
            return 2
    return run_demo(requests=args.requests, trace_file=args.trace_file)


if __name__ == "__main__":
    sys.exit(main())
