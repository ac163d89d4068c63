"""The Kubernetes manifests (deploy/kubernetes), checked offline: every file parses and is part
of the kustomization, names and references agree (secrets, config maps, service accounts,
roles, volumes, the driver name), images are pinned, and every `keel` command line in them is
one the binary accepts."""

import re
import shlex
import subprocess
from pathlib import Path

import yaml

from conftest import KEEL_BIN, ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"
DRIVER = re.search(r'pub const DRIVER_NAME: &str = "([^"]+)"', (ROOT / "crates/csi/src/lib.rs").read_text()).group(1)
CSI_PARAMETERS = re.findall(r'^\s+"(\w+)",$', (ROOT / "crates/csi/src/controller.rs").read_text().split("const PARAMETERS")[1].split("];")[0], re.M)
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CSIDriver", "StorageClass", "VolumeSnapshotClass"}


def documents(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization():
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def objects():
    return [(name, d) for name in kustomization()["resources"] for d in documents(DEPLOY / name)]


def pod_specs():
    for name, obj in objects():
        if obj["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            yield name, obj, obj["spec"]["template"]["spec"]


def keel_command_lines():
    """Every `keel ...` command a container runs, as argument lists (shell wrappers unfolded)."""
    for _, obj, spec in pod_specs():
        for container in spec.get("initContainers", []) + spec["containers"]:
            words = container.get("command", []) + container.get("args", [])
            if words[:2] == ["/bin/sh", "-c"]:
                script = " ".join(words[2:]).replace("\\\n", " ")
                for line in re.findall(r"exec (keel .*?)(?:\n|$)", script, re.S):
                    yield obj["metadata"]["name"], shlex.split(line.replace("$join", ""))
            elif words and words[0] == "keel":
                yield obj["metadata"]["name"], words


def test_every_manifest_is_in_the_kustomization_and_well_formed():
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, f"not in the kustomization: {on_disk - listed}; missing: {listed - on_disk}"
    names = set()
    for file, obj in objects():
        assert {"apiVersion", "kind", "metadata"} <= obj.keys(), f"{file}: {obj}"
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in names, f"{key} defined twice"
        names.add(key)
        if obj["kind"] not in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], f"{key}: the kustomization sets the namespace"
    for file in DEPLOY.joinpath("examples").glob("*.yaml"):
        assert documents(file), f"{file} is empty"


def test_names_and_references_agree():
    objs = [obj for _, obj in objects()]
    by_kind = {}
    for obj in objs:
        by_kind.setdefault(obj["kind"], set()).add(obj["metadata"]["name"])
    secrets = {s["name"]: set(s["files"]) for s in kustomization()["secretGenerator"]}
    config_maps = {c["name"]: {lit.split("=")[0] for lit in c["literals"]} for c in kustomization()["configMapGenerator"]}
    assert by_kind["CSIDriver"] == {DRIVER}
    assert {o["provisioner"] for o in objs if o["kind"] == "StorageClass"} == {DRIVER}
    assert {o["driver"] for o in objs if o["kind"] == "VolumeSnapshotClass"} == {DRIVER}
    for obj in objs:
        if obj["kind"] == "StorageClass":
            for parameter in obj["parameters"]:
                assert parameter.startswith("csi.storage.k8s.io/") or parameter in CSI_PARAMETERS, parameter
        if obj["kind"] in ("ClusterRoleBinding", "RoleBinding"):
            role_kind = obj["roleRef"]["kind"]
            assert obj["roleRef"]["name"] in by_kind[role_kind], obj["metadata"]["name"]
            for subject in obj["subjects"]:
                assert subject["name"] in by_kind["ServiceAccount"] and subject["namespace"] == "keel-system"
    for _, obj, spec in pod_specs():
        name = obj["metadata"]["name"]
        assert spec.get("serviceAccountName", "default") in by_kind.get("ServiceAccount", set()) | {"default"}, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for volume in volumes.values():
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets, name
        for container in spec.get("initContainers", []) + spec["containers"]:
            image = container["image"]
            assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), f"{name}: unpinned image {image}"
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}/{container['name']}: no volume {mount['name']}"
            for env in container.get("env", []):
                ref = env.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    assert ref["secretKeyRef"]["key"] in secrets[ref["secretKeyRef"]["name"]], env
                if "configMapKeyRef" in ref:
                    assert ref["configMapKeyRef"]["key"] in config_maps[ref["configMapKeyRef"]["name"]], env
    # The node plugin registers the socket the kubelet will dial for this driver.
    node = next(spec for _, obj, spec in pod_specs() if obj["metadata"]["name"] == "keel-csi-node")
    registrar = next(c for c in node["containers"] if c["name"] == "node-driver-registrar")
    assert f"--kubelet-registration-path=/var/lib/kubelet/plugins/{DRIVER}/csi.sock" in registrar["args"]
    assert any(v.get("hostPath", {}).get("path") == f"/var/lib/kubelet/plugins/{DRIVER}" for v in node["volumes"])


def test_every_keel_command_line_is_accepted_by_the_binary():
    seen = set()
    for owner, words in keel_command_lines():
        assert words[0] == "keel", words
        subcommand = [w for w in words[1:2]]
        help_text = subprocess.run([KEEL_BIN, *subcommand, "--help"], capture_output=True, text=True, check=True).stdout
        for word in words[2:]:
            if word.startswith("--"):
                flag = word.split("=")[0]
                assert re.search(rf"(^|\s){re.escape(flag)}[\s=<]", help_text, re.M), f"{owner}: keel {subcommand[0]} has no {flag}"
        seen.add(subcommand[0])
    assert seen == {"server", "doctor", "csi"}, seen
