"""Render the plain manifests deploy/manifests/<provider>.yaml from the chart (`make manifests`).

Each is the chart with deploy/helm/vkubelet/ci/<provider>-values.yaml, in the namespace
vkubelet-system (a Namespace object included), for the pinned Kubernetes version. (No vm one:
the chart refuses the vm provider, docs/host-install.md.)
`--check` renders into memory and fails if a file differs: the integration test runs it, so the
manifests cannot drift from the chart. helm is built from its Go module, cached on first use.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from vkubelet.devcluster import ensure_helm, kubernetes_version

DEPLOY = Path(__file__).resolve().parent
CHART = DEPLOY / "helm" / "vkubelet"
MANIFESTS = DEPLOY / "manifests"
NAMESPACE = "vkubelet-system"
PROVIDERS = ("mock", "ssh", "cluster")
HEADER = (
    "# Rendered from deploy/helm/vkubelet with ci/{provider}-values.yaml by `make manifests`;\n"
    "# do not edit (tests/integration/test_helm_chart.py fails when it differs from the chart).\n"
)


def render(provider: str, helm: Path | None = None) -> str:
    helm = helm or ensure_helm(lambda line: print(line, file=sys.stderr))
    out = subprocess.run(
        [
            str(helm),
            "template",
            "vkubelet",
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--kube-version",
            kubernetes_version(),
            "--values",
            str(CHART / "ci" / f"{provider}-values.yaml"),
            "--set",
            "createNamespace=true",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return HEADER.format(provider=provider) + out.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file is out of date")
    args = parser.parse_args()
    stale = []
    for provider in PROVIDERS:
        path = MANIFESTS / f"{provider}.yaml"
        text = render(provider)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(DEPLOY.parent)))
        else:
            MANIFESTS.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date with the chart: {', '.join(stale)}; run `make manifests`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
