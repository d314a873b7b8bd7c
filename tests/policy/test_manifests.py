"""Loading a directory of YAML: sources, per-file and per-document rejections, ignored kinds."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolegate_policy.manifests import load_manifest_dir
from rolegate_policy.verdicts import AcceptedReason

from .builders import PLANTED_SECRET

PROVIDER = """\
apiVersion: rolegate.dev/v1alpha1
kind: ProviderPolicy
metadata: {name: NAME, namespace: ns, generation: 2}
spec: {endpoint: "http://h/v1", models: [{name: m}]}
"""


def write(directory: Path, name: str, text: str) -> None:
    (directory / name).write_text(text, encoding="utf-8")


def test_sources_name_the_file_and_the_document(tmp_path: Path) -> None:
    write(tmp_path, "b.yaml", PROVIDER.replace("NAME", "one"))
    write(tmp_path, "a.yml", "---\n" + PROVIDER.replace("NAME", "two") + "---\n")
    write(
        tmp_path,
        "c.yaml",
        PROVIDER.replace("NAME", "three") + "---\n---\n" + PROVIDER.replace("NAME", "four"),
    )
    result = load_manifest_dir(tmp_path)
    assert result.files == ("a.yml", "b.yaml", "c.yaml")
    # Empty documents (a trailing or doubled ---) are not counted.
    assert [(m.source, m.name) for m in result.manifests] == [
        ("a.yml", "two"),
        ("b.yaml", "one"),
        ("c.yaml#1", "three"),
        ("c.yaml#2", "four"),
    ]
    first = result.manifests[0]
    assert (first.api_version, first.kind, first.namespace, first.generation) == (
        "rolegate.dev/v1alpha1",
        "ProviderPolicy",
        "ns",
        2,
    )
    assert first.spec == {"endpoint": "http://h/v1", "models": [{"name": "m"}]}
    assert result.rejected == ()


def test_only_yaml_files_directly_in_the_directory_are_read(tmp_path: Path) -> None:
    write(tmp_path, "p.yaml", PROVIDER.replace("NAME", "p"))
    write(tmp_path, ".hidden.yaml", "{{{")
    write(tmp_path, "notes.txt", "{{{")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub", "q.yaml", PROVIDER.replace("NAME", "q"))
    (tmp_path / "dir.yaml").mkdir()
    result = load_manifest_dir(tmp_path)
    assert result.files == ("p.yaml",)
    assert [m.name for m in result.manifests] == ["p"]


def test_a_syntax_error_rejects_one_file_and_names_the_line(tmp_path: Path) -> None:
    write(tmp_path, "bad.yaml", f"kind: ProviderPolicy\nspec:\n  apiKey: [{PLANTED_SECRET}\n")
    write(tmp_path, "good.yaml", PROVIDER.replace("NAME", "good"))
    result = load_manifest_dir(tmp_path)
    assert [m.name for m in result.manifests] == ["good"]
    (rejected,) = result.rejected
    assert rejected.source == "bad.yaml"
    assert rejected.reason is AcceptedReason.INVALID_MANIFEST
    assert rejected.message.startswith("YAML syntax error at line 4, column 1:")
    assert PLANTED_SECRET not in rejected.message


def test_documents_before_a_syntax_error_are_kept(tmp_path: Path) -> None:
    write(
        tmp_path,
        "multi.yaml",
        PROVIDER.replace("NAME", "kept")
        + "---\nkey: : :\n---\n"
        + PROVIDER.replace("NAME", "lost"),
    )
    result = load_manifest_dir(tmp_path)
    assert [m.source for m in result.manifests] == ["multi.yaml#1"]
    (rejected,) = result.rejected
    assert rejected.source == "multi.yaml#2"
    assert "line 6" in rejected.message
    assert "this document and any after it in the file were not read" in rejected.message


def test_a_repeated_key_is_an_error_not_a_silent_override(tmp_path: Path) -> None:
    write(tmp_path, "dup.yaml", PROVIDER.replace("NAME", "x") + "spec: {}\n")
    (rejected,) = load_manifest_dir(tmp_path).rejected
    assert "duplicate key 'spec' (first at line 4)" in rejected.message
    assert "line 5" in rejected.message


def test_merge_keys_are_not_mistaken_for_duplicates(tmp_path: Path) -> None:
    write(
        tmp_path,
        "merge.yaml",
        "apiVersion: rolegate.dev/v1alpha1\nkind: ProviderPolicy\nmetadata: {name: m}\n"
        "x-common: &common {endpoint: 'http://h/v1'}\n"
        "spec:\n  <<: *common\n  endpoint: 'http://other/v1'\n  models: [{name: m}]\n",
    )
    (manifest,) = load_manifest_dir(tmp_path).manifests
    assert manifest.spec["endpoint"] == "http://other/v1"


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ("kind: RoleTable\nmetadata: {name: a}\n", ["apiVersion"]),
        ("apiVersion: rolegate.dev/v1alpha1\nmetadata: {name: a}\n", ["kind"]),
        ("apiVersion: rolegate.dev/v1alpha1\nkind: RoleTable\n", ["metadata.name"]),
        ("apiVersion: rolegate.dev/v1alpha1\nkind: RoleTable\nmetadata: [a]\n", ["metadata"]),
        (
            "apiVersion: rolegate.dev/v1alpha1\nkind: RoleTable\nmetadata: {name: a}\nspec: 3\n",
            ["spec"],
        ),
        ("{}\n", ["apiVersion", "kind"]),
    ],
)
def test_missing_envelope_fields_are_rejected(tmp_path: Path, text: str, fields: list[str]) -> None:
    write(tmp_path, "x.yaml", text)
    result = load_manifest_dir(tmp_path)
    (rejected,) = result.rejected
    assert [e.field for e in rejected.errors] == fields
    assert result.manifests == ()


def test_non_mapping_documents_and_bad_bytes_are_rejected(tmp_path: Path) -> None:
    write(tmp_path, "list.yaml", "- a\n- b\n")
    (tmp_path / "latin1.yaml").write_bytes(b"kind: caf\xe9\n")
    result = load_manifest_dir(tmp_path)
    messages = {v.source: v.message for v in result.rejected}
    assert messages == {
        "latin1.yaml": "is not UTF-8 text (bad byte at offset 9)",
        "list.yaml": "is not a mapping (a Kubernetes object with apiVersion and kind)",
    }


def test_other_groups_are_ignored_even_without_a_name(tmp_path: Path) -> None:
    write(
        tmp_path,
        "k.yaml",
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n---\n"
        "apiVersion: v1\nkind: Secret\nmetadata: {name: s}\n"
        f"stringData: {{k: {PLANTED_SECRET}}}\n",
    )
    result = load_manifest_dir(tmp_path)
    assert result.rejected == ()
    assert [(i.source, i.kind, i.name) for i in result.ignored] == [
        ("k.yaml#1", "Kustomization", None),
        ("k.yaml#2", "Secret", "s"),
    ]
    assert PLANTED_SECRET not in repr(result)


def test_a_missing_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_manifest_dir(tmp_path / "nope")
    write(tmp_path, "file.yaml", "")
    with pytest.raises(NotADirectoryError):
        load_manifest_dir(tmp_path / "file.yaml")
