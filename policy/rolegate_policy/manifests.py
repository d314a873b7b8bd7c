"""Reading manifests: a directory of YAML (standalone proxy, `rolegate compile`) or
objects from the API server (operator), into one `Manifest` shape compile accepts.

All file I/O of the policy package lives here, so `compile` stays a pure function.
A broken file or document is a rejection recorded against its source; it never stops
the other files from loading. Documents of other API groups (a Secret, a Deployment
kept next to the policies) are recorded as ignored, not as errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rolegate_policy import GROUP
from rolegate_policy.field_errors import FieldError, shorten
from rolegate_policy.verdicts import AcceptedReason, IgnoredDocument, ResourceVerdict

MANIFEST_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class Manifest:
    """One resource document, before its spec is validated.

    `source` says where it came from: for a file, its path relative to the directory,
    plus `#<n>` (the n-th document, counting from 1) when the file holds several; for
    an object from the API server, whatever the caller passes (`namespace/name`).
    """

    source: str
    api_version: str
    kind: str
    name: str
    namespace: str | None
    generation: int | None
    spec: dict[str, Any]

    @property
    def group(self) -> str:
        group, _, _ = self.api_version.rpartition("/")
        return group

    @property
    def display_name(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


class ManifestError(ValueError):
    """An object that is not a resource at all (no apiVersion, kind or metadata.name)."""

    def __init__(self, source: str, errors: Sequence[FieldError]) -> None:
        super().__init__(f"{source}: " + "; ".join(str(error) for error in errors))
        self.source = source
        self.errors = tuple(errors)


@dataclass(frozen=True)
class LoadResult:
    """What a directory held: rolegate.dev manifests, rejected documents, ignored ones."""

    manifests: tuple[Manifest, ...]
    rejected: tuple[ResourceVerdict, ...]
    ignored: tuple[IgnoredDocument, ...]
    # Files read, relative to the directory, in the order read.
    files: tuple[str, ...]


def manifest_from_object(obj: Mapping[str, Any], source: str) -> Manifest:
    """A `Manifest` from an object as the API server (or kopf) returns it.

    Raises `ManifestError` when apiVersion, kind or metadata.name is missing.
    """
    manifest, errors = _read(obj, source, require_name=True)
    if manifest is None:
        raise ManifestError(source, errors)
    return manifest


def load_manifest_dir(path: Path) -> LoadResult:
    """Every `*.yaml` / `*.yml` file directly in `path` (not in subdirectories; hidden
    files skipped), in name order, each read as multi-document YAML.

    Raises `NotADirectoryError` (or `FileNotFoundError`) when `path` is not a directory.
    """
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such directory")
        raise NotADirectoryError(f"{path}: not a directory")
    files = sorted(
        entry
        for entry in path.iterdir()
        if entry.suffix in MANIFEST_SUFFIXES and not entry.name.startswith(".") and entry.is_file()
    )
    manifests: list[Manifest] = []
    rejected: list[ResourceVerdict] = []
    ignored: list[IgnoredDocument] = []
    for file in files:
        relative = file.relative_to(path).as_posix()
        for item in _load_file(file, relative):
            if isinstance(item, Manifest):
                manifests.append(item)
            elif isinstance(item, IgnoredDocument):
                ignored.append(item)
            else:
                rejected.append(item)
    return LoadResult(
        manifests=tuple(manifests),
        rejected=tuple(rejected),
        ignored=tuple(ignored),
        files=tuple(file.relative_to(path).as_posix() for file in files),
    )


def _load_file(file: Path, relative: str) -> list[Manifest | IgnoredDocument | ResourceVerdict]:
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        return [_rejection(relative, f"is not UTF-8 text (bad byte at offset {error.start})")]
    except OSError as error:
        return [_rejection(relative, f"cannot be read: {error.strerror}")]

    documents: list[Any] = []
    syntax_error: str | None = None
    try:
        # A generator: documents before a syntax error are kept, the rest are lost.
        documents.extend(yaml.load_all(text, Loader=_StrictLoader))
    except yaml.YAMLError as error:
        syntax_error = _describe_yaml_error(error)
    documents = [document for document in documents if document is not None]

    several = len(documents) + (1 if syntax_error else 0) > 1

    def source_of(number: int) -> str:
        return f"{relative}#{number}" if several else relative

    items: list[Manifest | IgnoredDocument | ResourceVerdict] = []
    for number, document in enumerate(documents, start=1):
        items.append(_classify(document, source_of(number)))
    if syntax_error is not None:
        following = " (this document and any after it in the file were not read)" if several else ""
        items.append(_rejection(source_of(len(documents) + 1), syntax_error + following))
    return items


def _classify(document: Any, source: str) -> Manifest | IgnoredDocument | ResourceVerdict:
    if not isinstance(document, Mapping):
        return _rejection(source, "is not a mapping (a Kubernetes object with apiVersion and kind)")
    manifest, errors = _read(document, source, require_name=False)
    if manifest is None:
        kind = document.get("kind")
        metadata = document.get("metadata")
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        return ResourceVerdict(
            source=source,
            kind=kind if isinstance(kind, str) and kind else None,
            namespace=None,
            name=name if isinstance(name, str) and name else None,
            generation=None,
            accepted=False,
            reason=AcceptedReason.INVALID_MANIFEST,
            message="; ".join(str(error) for error in errors),
            errors=tuple(errors),
        )
    if manifest.group != GROUP:
        return IgnoredDocument(
            source=source,
            api_version=manifest.api_version,
            kind=manifest.kind,
            name=manifest.name or None,
        )
    if not manifest.name:
        error = FieldError(field="metadata.name", message="is required")
        return ResourceVerdict(
            source=source,
            kind=manifest.kind,
            namespace=manifest.namespace,
            name=None,
            generation=manifest.generation,
            accepted=False,
            reason=AcceptedReason.INVALID_MANIFEST,
            message=str(error),
            errors=(error,),
        )
    return manifest


def _read(
    document: Mapping[str, Any], source: str, *, require_name: bool
) -> tuple[Manifest | None, list[FieldError]]:
    """The envelope of a Kubernetes object; the spec is checked later, by compile.

    With `require_name=False` a missing name is left for the caller to judge: a
    non-rolegate document (a kustomization.yaml) legitimately has none.
    """
    errors: list[FieldError] = []
    api_version = _text(document.get("apiVersion"))
    kind = _text(document.get("kind"))
    metadata = document.get("metadata")
    spec = document.get("spec")
    if api_version is None:
        errors.append(
            FieldError(field="apiVersion", message=f"is required (e.g. {GROUP}/v1alpha1)")
        )
    if kind is None:
        errors.append(FieldError(field="kind", message="is required (RoleTable or ProviderPolicy)"))
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, Mapping):
        errors.append(FieldError(field="metadata", message="must be a mapping of fields"))
        metadata = {}
    name = _text(metadata.get("name"))
    if name is None and require_name:
        errors.append(FieldError(field="metadata.name", message="is required"))
    generation = metadata.get("generation")
    if spec is None:
        spec = {}
    if not isinstance(spec, Mapping):
        errors.append(FieldError(field="spec", message="must be a mapping of fields"))
    if errors or api_version is None or kind is None or not isinstance(spec, Mapping):
        return None, errors
    manifest = Manifest(
        source=source,
        api_version=api_version,
        kind=kind,
        name=name or "",
        namespace=_text(metadata.get("namespace")),
        # bool is an int in Python; a `generation: true` is not a generation.
        generation=generation
        if isinstance(generation, int) and not isinstance(generation, bool)
        else None,
        spec=_plain(spec),
    )
    return manifest, []


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _plain(value: Any) -> Any:
    """Plain dicts and lists all the way down (kopf hands out read-only mapping views)."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def _rejection(source: str, message: str) -> ResourceVerdict:
    return ResourceVerdict(
        source=source,
        kind=None,
        namespace=None,
        name=None,
        generation=None,
        accepted=False,
        reason=AcceptedReason.INVALID_MANIFEST,
        message=message,
        errors=(FieldError(field="", message=message),),
    )


def _describe_yaml_error(error: yaml.YAMLError) -> str:
    # Built from the error's parts, never `str(error)`: that quotes the offending line,
    # which may be the very line holding a pasted key.
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}"
        problem = shorten(error.problem or "invalid YAML", 120)
        context = ""
        if error.context and error.context_mark is not None:
            context = f" ({shorten(error.context, 80)} at line {error.context_mark.line + 1})"
        return f"YAML syntax error at {where}: {problem}{context}"
    return "YAML syntax error"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping.

    Plain PyYAML keeps the last of two `patienceSeconds:` lines without a word; the API
    server's decoder refuses them, and so do we, so a typo cannot silently win.
    """


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first_line = seen.get(key)
        except TypeError:  # an unhashable key; the constructor reports it properly below
            continue
        if first_line is not None:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"found duplicate key {shorten(key, 40)!r} (first at line {first_line})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
