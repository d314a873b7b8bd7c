"""The rolegate policy model and its compiler.

Pure code: manifests in, proxy configuration and per-resource verdicts out. It imports
neither kopf nor aiohttp (an import-linter contract enforces it), so the operator and the
standalone proxy share exactly the same compile step.
"""

GROUP = "rolegate.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
