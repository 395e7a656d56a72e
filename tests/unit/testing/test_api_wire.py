"""The fake API server's patch semantics (``testing/api_wire.merge_patch``): JSON merge patch
(RFC 7386) and the strategic merge patch of core/v1's patch tags."""

from __future__ import annotations

import pytest

from kfp_elastic.testing.api_wire import merge_patch

POD = {
    "metadata": {"labels": {"a": "1", "b": "2"}, "finalizers": ["x.io/keep"]},
    "spec": {
        "tolerations": [{"key": "t1"}],
        "containers": [
            {
                "name": "main",
                "args": ["--one"],
                "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            }
        ],
    },
}


def test_a_json_merge_patch_replaces_lists_and_deletes_null_keys() -> None:
    patch = {"metadata": {"labels": {"a": None, "c": "3"}}, "spec": {"tolerations": []}}
    out = merge_patch(POD, patch)
    assert out["metadata"]["labels"] == {"b": "2", "c": "3"}
    assert out["spec"]["tolerations"] == []
    env = merge_patch(POD, {"spec": {"containers": [{"name": "main"}]}})
    assert env["spec"]["containers"] == [{"name": "main"}]  # the whole list replaced
    assert POD["spec"]["containers"][0]["env"][0] == {"name": "A", "value": "1"}  # not mutated


def test_a_strategic_merge_patch_merges_the_lists_kubernetes_merges_by_key() -> None:
    patch = {
        "metadata": {"finalizers": ["x.io/keep", "x.io/new"]},
        "spec": {
            "tolerations": [{"key": "t2"}],  # no patch strategy: replaced
            "containers": [
                {
                    "name": "main",
                    "args": ["--two"],  # replaced
                    "env": [{"name": "B", "value": "22"}, {"name": "C", "value": "3"}],
                    "volumeMounts": [{"name": "scratch", "mountPath": "/data"}],
                }
            ],
        },
    }
    out = merge_patch(POD, patch, strategic=True)
    main = out["spec"]["containers"][0]
    assert main["env"] == [
        {"name": "A", "value": "1"},
        {"name": "B", "value": "22"},
        {"name": "C", "value": "3"},
    ]
    assert main["args"] == ["--two"]
    assert main["volumeMounts"] == [{"name": "scratch", "mountPath": "/data"}]  # by mountPath
    assert out["spec"]["tolerations"] == [{"key": "t2"}]
    assert out["metadata"]["finalizers"] == ["x.io/keep", "x.io/new"]


def test_strategic_directives_delete_an_item_or_replace_a_list() -> None:
    drop = {"spec": {"containers": [{"name": "main", "env": [{"name": "A", "$patch": "delete"}]}]}}
    assert merge_patch(POD, drop, True)["spec"]["containers"][0]["env"] == [
        {"name": "B", "value": "2"}
    ]
    only = [{"$patch": "replace"}, {"name": "Z", "value": "9"}]
    replaced = merge_patch(POD, {"spec": {"containers": [{"name": "main", "env": only}]}}, True)
    assert replaced["spec"]["containers"][0]["env"] == [{"name": "Z", "value": "9"}]
    merge = merge_patch(POD, {"spec": {"containers": [{"name": "main", "$patch": "merge"}]}}, True)
    assert merge == POD  # the default
    with pytest.raises(ValueError, match="directive 'drop'"):
        merge_patch(POD, {"spec": {"containers": [{"name": "main", "$patch": "drop"}]}}, True)
