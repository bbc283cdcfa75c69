"""``kvstrata operator``: run the kopf operator and the admission webhook.

Top-level imports stay light (``kvstrata --help`` must answer at once); kopf
and the Kubernetes client are imported in :func:`run`. Each flag has an
environment default (``KVSTRATA_OPERATOR_*``) so the chart can set them.
"""

from __future__ import annotations

import argparse
import os
import sys


def _env(name: str, default: str) -> str:
    return os.environ.get(f"KVSTRATA_OPERATOR_{name}", default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The operator's flags, each with its environment default."""
    _add_scope_arguments(parser)
    _add_webhook_arguments(parser)
    _add_serving_arguments(parser)


def _add_scope_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the operator lives and which namespaces it watches."""
    parser.add_argument(
        "--namespace",
        default=_env("NAMESPACE", os.environ.get("POD_NAMESPACE", "kvstrata-system")),
        help="namespace of the operator (its webhook Secret lives there)",
    )
    parser.add_argument(
        "--watch-namespace",
        action="append",
        default=None,
        help="watch only this namespace (repeatable); default: the whole cluster",
    )


def _add_webhook_arguments(parser: argparse.ArgumentParser) -> None:
    """The admission webhook: its port, names and certificates."""
    from kvstrata.cli import port

    parser.add_argument(
        "--webhook-port",
        type=port,
        default=_env("WEBHOOK_PORT", "9443"),  # argparse applies ``type`` to a string default
        help="HTTPS port of the admission webhook; 0 disables the webhook",
    )
    parser.add_argument("--webhook-service", default=_env("WEBHOOK_SERVICE", "kvstrata-webhook"))
    parser.add_argument(
        "--webhook-config",
        default=_env("WEBHOOK_CONFIG", "kvstrata-webhook"),
        help="MutatingWebhookConfiguration whose caBundle the operator keeps and whose"
        " namespaceSelector tells in which namespaces a workload may be rolled",
    )
    parser.add_argument("--webhook-secret", default=_env("WEBHOOK_SECRET", "kvstrata-webhook-tls"))
    parser.add_argument(
        "--cert-dir",
        default=_env("CERT_DIR", "/tmp/kvstrata-webhook"),
        help="directory of tls.crt/tls.key served by the webhook",
    )
    parser.add_argument(
        "--cert-manager",
        action="store_true",
        default=_env("CERT_MANAGER", "false").lower() == "true",
        help="certificates come from cert-manager (mounted in --cert-dir); do not issue any",
    )


def _add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """Probes, metrics, peering between replicas and logging."""
    from kvstrata.cli import port

    parser.add_argument(
        "--liveness", default=_env("LIVENESS", "http://0.0.0.0:8080/healthz"), help="kopf probe URL"
    )
    parser.add_argument(
        "--metrics-port",
        type=port,
        default=_env("METRICS_PORT", "9465"),
        help="port of the operator's Prometheus /metrics; 0 disables it",
    )
    parser.add_argument(
        "--peering",
        default=_env("PEERING", ""),
        help="kopf peering name shared by the replicas: only the highest-priority one"
        " reconciles, every one serves the webhook; empty runs standalone",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="this replica's peering priority; default: derived from $POD_NAME",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    import kopf
    from kubernetes.config import ConfigException

    from kvstrata.operator import handlers
    from kvstrata.operator.kube import KubeCluster
    from kvstrata.operator.metrics import OperatorMetrics
    from kvstrata.operator.metrics import serve as serve_metrics
    from kvstrata.operator.peering import run_options

    try:
        cluster = KubeCluster()
    except ConfigException as exc:
        message = str(exc)
        if not message.startswith("kubeconfig "):  # neither a kubeconfig nor a pod
            message = f"no Kubernetes configuration (in-cluster or KUBECONFIG): {message}"
        print(f"kvstrata operator: {message}", file=sys.stderr)
        return 2
    registry = kopf.OperatorRegistry()
    handlers.register(registry, webhook=args.webhook_port > 0)
    metrics = OperatorMetrics()
    if args.metrics_port:
        try:
            serve_metrics(metrics, "0.0.0.0", args.metrics_port)
        except OSError as exc:
            print(f"kvstrata operator: --metrics-port {args.metrics_port}: {exc}", file=sys.stderr)
            return 1
    memo = kopf.Memo(options=args, cluster=cluster, metrics=metrics)
    namespaces = args.watch_namespace or ()
    kopf.configure(verbose=args.verbose)
    kopf.run(
        registry=registry,
        memo=memo,
        **run_options(args.peering, args.priority, os.environ.get("POD_NAME")),
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness or None,
    )
    return 0
