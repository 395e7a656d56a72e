"""Server-side printing and Events of the fake API server, pure: the cells kube-apiserver's
printers give, the events.k8s.io/v1 form of an Event, field selectors per kind."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from kfp_elastic.testing.api_events import new_event, to_events_v1
from kfp_elastic.testing.api_tables import age, table
from kfp_elastic.testing.api_wire import ApiError, fields_match, parse_field_selector

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def cells(resource: str, obj: dict) -> list:
    return table(resource, [obj], "7")["rows"][0]["cells"]


def columns(resource: str, wide: bool = False) -> list[str]:
    definitions = table(resource, [], "7")["columnDefinitions"]
    return [c["name"] for c in definitions if wide or c["priority"] == 0]


def test_age_is_kubectls_human_duration() -> None:
    assert age("2026-01-01T11:59:18Z", NOW) == "42s"
    assert age("2026-01-01T11:57:55Z", NOW) == "2m5s"
    assert age("2026-01-01T11:58:00Z", NOW) == "2m"
    assert age("2026-01-01T11:45:00Z", NOW) == "15m"
    assert age("2026-01-01T08:40:00Z", NOW) == "3h20m"
    assert age("2025-12-31T16:00:00Z", NOW) == "20h"
    assert age("2025-12-30T09:00:00Z", NOW) == "2d3h"
    assert age("2025-12-02T12:00:00Z", NOW) == "30d"
    assert age(None, NOW) == "<unknown>"


def test_node_row_status_roles_and_wide_cells() -> None:
    node = {
        "metadata": {"name": "n", "labels": {"node-role.kubernetes.io/worker": ""}},
        "spec": {"unschedulable": True},
        "status": {
            "conditions": [{"type": "Ready", "status": "Unknown"}],
            "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
            "nodeInfo": {"kubeletVersion": "v1.36.0"},
        },
    }
    assert columns("nodes") == ["Name", "Status", "Roles", "Age", "Version"]
    row = cells("nodes", node)
    assert row[:3] == ["n", "NotReady,SchedulingDisabled", "worker"]
    assert row[4:] == ["v1.36.0", "10.0.0.1", "<none>", "<unknown>", "<unknown>", "<unknown>"]


def test_event_row_names_the_object_and_its_source() -> None:
    pod = {"kind": "Pod", "apiVersion": "v1", "metadata": {"name": "p", "namespace": "ns"}}
    event = new_event(
        pod,
        "Started",
        "Started container main ",
        component="kubelet",
        now="2026-01-01T12:00:00Z",
        now_ns=255,
        host="node-1",
        field_path="spec.containers{main}",
    )
    assert event["metadata"] == {"name": "p.ff", "namespace": "ns"}
    assert columns("events") == ["Last Seen", "Type", "Reason", "Object", "Message"]
    row = cells("events", event)
    assert row[1:5] == ["Normal", "Started", "pod/p", "spec.containers{main}"]
    assert row[5:7] == ["kubelet, node-1", "Started container main"]
    assert row[8:] == [1, "p.ff"]
    newer = to_events_v1(event)
    assert newer["regarding"]["name"] == "p" and newer["note"] == event["message"]
    assert newer["reportingController"] == "kubelet" and newer["deprecatedCount"] == 1


def test_cluster_scoped_objects_events_live_in_default() -> None:
    node = {"kind": "Node", "apiVersion": "v1", "metadata": {"name": "n", "uid": "u"}}
    event = new_event(node, "NodeReady", "m", component="kubelet", now="x", now_ns=1)
    assert event["metadata"]["namespace"] == "default"
    assert "namespace" not in event["involvedObject"]  # what describe node selects on


def test_kinds_without_a_printer_get_name_and_created_at() -> None:
    role = {"metadata": {"name": "r", "creationTimestamp": "2026-01-01T00:00:00Z"}}
    assert columns("roles") == ["Name", "Created At"]
    assert cells("roles", role) == ["r", "2026-01-01T00:00:00Z"]


def test_field_selectors_per_kind() -> None:
    node = {"metadata": {"name": "n"}, "spec": {}}
    assert fields_match(parse_field_selector("spec.unschedulable=false", "nodes"), node)
    assert not fields_match(parse_field_selector("spec.unschedulable==true", "nodes"), node)
    event = {"involvedObject": {"name": "p", "kind": "Pod"}, "source": {"component": "kubelet"}}
    selector = parse_field_selector("involvedObject.kind=Pod,source=kubelet", "events")
    assert fields_match(selector, event)
    assert fields_match(parse_field_selector("metadata.name!=x", "configmaps"), node)
    with pytest.raises(ApiError) as refused:
        parse_field_selector("spec.nodeName=n", "configmaps")
    assert refused.value.status["code"] == 400
    assert refused.value.status["message"] == 'field label not supported: "spec.nodeName"'
