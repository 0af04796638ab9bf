"""The KubeRay RayService runs the same Serve application as deployments/dart.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deployments.config import AppConfig

ROOT = Path(__file__).resolve().parents[2]


def _docs():
    local = yaml.safe_load((ROOT / "deployments/dart.yaml").read_text())
    manifests = list(yaml.safe_load_all((ROOT / "k8s/rayservice.yaml").read_text()))
    service = next(m for m in manifests if m["kind"] == "RayService")
    return local, service, yaml.safe_load(service["spec"]["serveConfigV2"])


def test_serve_config_matches_except_cluster_resources():
    local, _, cluster = _docs()
    for key in ("proxy_location", "http_options", "grpc_options", "logging_config"):
        assert cluster[key] == local[key], key
    (la,), (ca,) = local["applications"], cluster["applications"]
    assert {k: v for k, v in ca.items() if k != "deployments"} == {k: v for k, v in la.items() if k != "deployments"}
    AppConfig.model_validate(ca["args"])  # the args are valid for the app
    ld = {d["name"]: d for d in la["deployments"]}
    cd = {d["name"]: d for d in ca["deployments"]}
    assert set(ld) == set(cd) == {"OpenAIIngress", "DartEngine", "NgramService"}
    # on the cluster the engine takes a GPU and the n-gram service the custom resource
    assert cd["DartEngine"]["ray_actor_options"]["num_gpus"] == 1
    assert ld["DartEngine"]["ray_actor_options"]["num_gpus"] == 0
    assert cd["NgramService"]["ray_actor_options"]["resources"] == {"ngram_host": 1}
    for name in ld:
        for key in ("max_ongoing_requests", "max_queued_requests", "logging_config"):
            assert ld[name].get(key) == cd[name].get(key), (name, key)
    # the engines' live-corpus mirrors call the n-gram replica's locate twice a second each: no access-log line per call
    assert ld["NgramService"]["logging_config"] == {"enable_access_log": False}


def test_cluster_has_the_node_groups_the_app_needs():
    _, service, _ = _docs()
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    gpu = groups["gpu-engines"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu["nvidia.com/gpu"] == 1
    assert "ngram_host" in groups["ngram-hosts"]["rayStartParams"]["resources"]
    head_ports = {p["containerPort"] for p in service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
                  ["containers"][0]["ports"]}
    assert {8000, 9000} <= head_ports


def test_the_qwen3_reference_example_is_a_valid_gpu_config():
    """deployments/dart-qwen3-reference.yaml: valid app args, the reference's paths and search
    settings, GPU engines, the n-gram service on the n-gram host with the target's tokenizer; an
    EAGLE-3 head loaded beside the DART head on the same target (the reference demo's pair, picked
    per request), valid but not run here."""
    example = yaml.safe_load((ROOT / "deployments/dart-qwen3-reference.yaml").read_text())
    local = yaml.safe_load((ROOT / "deployments/dart.yaml").read_text())
    for key in ("proxy_location", "http_options", "grpc_options"):
        assert example[key] == local[key], key
    app, = example["applications"]
    e3 = AppConfig.model_validate(app["args"])
    assert (e3.method, e3.eagle3_head) == ("dart", "/models/Qwen3-8B_eagle3")
    assert (e3.eagle3_total_tokens, e3.eagle3_depth, e3.eagle3_top_k) == (60, 7, 10)
    assert app["import_path"] == local["applications"][0]["import_path"]
    cfg = AppConfig.model_validate(app["args"])
    assert (cfg.top_k, cfg.beam_width, cfg.context_weight) == (25, 20, 0.0)
    assert cfg.ngram.trie == "/models/dart-ngram" and cfg.ngram.tokenizer == cfg.model
    deps = {d["name"]: d for d in app["deployments"]}
    assert deps["DartEngine"]["ray_actor_options"]["num_gpus"] == 1
    assert deps["NgramService"]["ray_actor_options"]["resources"] == {"ngram_host": 1}


# -- the KubeRay bundle: validation ------------------------------------------------------

K8S_VERSION = "1.30.0"  # Kubernetes API version the standard objects are validated against

# The fields of KubeRay's ray.io/v1 RayService that k8s/rayservice.yaml relies on, with their types,
# as KubeRay declares them (ray-operator/apis/ray/v1/rayservice_types.go and raycluster_types.go at
# commit 026f1433 of ray-project/kuberay, the v1 API of the KubeRay 1.1 line): json tags without
# omitempty are required; *int32 fields are int32; maps are map[string]string.  Every object we
# write is closed (additionalProperties: false) so that a misspelt field fails here instead of
# being dropped by the API server.  Pod templates are checked separately as core/v1 objects.
_INT32 = {"type": "integer", "minimum": -2**31, "maximum": 2**31 - 1}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_POD_TEMPLATE = {"type": "object"}
KUBERAY_RAYSERVICE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayService"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["serveConfigV2", "rayClusterConfig"],
            "properties": {
                "serveConfigV2": {"type": "string"},
                "rayClusterConfig": {
                    "type": "object", "additionalProperties": False, "required": ["headGroupSpec"],
                    "properties": {
                        "rayVersion": {"type": "string"},
                        "enableInTreeAutoscaling": {"type": "boolean"},
                        "autoscalerOptions": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                                           "idleTimeoutSeconds": _INT32, "image": {"type": "string"},
                                           "resources": {"type": "object"}}},
                        "headGroupSpec": {
                            "type": "object", "additionalProperties": False, "required": ["rayStartParams", "template"],
                            "properties": {"rayStartParams": _STRING_MAP, "template": _POD_TEMPLATE,
                                           "serviceType": {"type": "string"}, "enableIngress": {"type": "boolean"}}},
                        "workerGroupSpecs": {"type": "array", "items": {
                            "type": "object", "additionalProperties": False,
                            "required": ["groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"],
                            "properties": {"groupName": {"type": "string"}, "replicas": _INT32, "minReplicas": _INT32,
                                           "maxReplicas": _INT32, "numOfHosts": _INT32, "rayStartParams": _STRING_MAP,
                                           "template": _POD_TEMPLATE}}},
                    },
                },
            },
        },
    },
}


def _manifests(name: str) -> list[dict]:
    return [m for m in yaml.safe_load_all((ROOT / "k8s" / name).read_text()) if m]


def test_the_rayservice_matches_kuberays_field_structure():
    import jsonschema

    _, service, _ = _docs()
    jsonschema.validate(service, KUBERAY_RAYSERVICE_SCHEMA)
    broken = yaml.safe_load(yaml.safe_dump(service))
    broken["spec"]["rayClusterConfig"]["enableInTreeAutoScaling"] = True  # a misspelling is caught
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, KUBERAY_RAYSERVICE_SCHEMA)


def test_autoscaling_spans_the_engine_replicas():
    _, service, cluster = _docs()
    config = service["spec"]["rayClusterConfig"]
    assert config["enableInTreeAutoscaling"] is True
    engine = next(d for d in cluster["applications"][0]["deployments"] if d["name"] == "DartEngine")
    gpu = next(g for g in config["workerGroupSpecs"] if g["groupName"] == "gpu-engines")
    # one engine replica per GPU worker: the GPU group can grow to the replicas Serve may ask for
    assert gpu["maxReplicas"] >= engine["autoscaling_config"]["max_replicas"] * engine["ray_actor_options"]["num_gpus"]


def test_standard_objects_and_pod_templates_pass_kubernetes_validate():
    import kubernetes_validate

    _, service, _ = _docs()
    config = service["spec"]["rayClusterConfig"]
    templates = [config["headGroupSpec"]["template"]] + [g["template"] for g in config["workerGroupSpecs"]]
    objects = [m for m in _manifests("rayservice.yaml") if m["kind"] != "RayService"]
    objects += _manifests("tries-pvc.yaml") + _manifests("trie-build-job.yaml") + _manifests("ngram-networkpolicy.yaml")
    objects += [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{i}"}, "template": t}
                for i, t in enumerate(templates)]
    assert {o["kind"] for o in objects} >= {"Service", "PersistentVolumeClaim", "Job", "PodTemplate", "NetworkPolicy"}
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(_manifests("trie-build-job.yaml")[0]))
    bad["spec"]["template"]["spec"]["containers"][0]["comand"] = ["python"]  # strict: unknown fields fail
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_build_job_writes_the_trie_the_ngram_host_reads():
    from ngram_service.cache import default_trie_path

    (pvc,) = _manifests("tries-pvc.yaml")
    (job,) = _manifests("trie-build-job.yaml")
    _, service, cluster = _docs()
    host = next(g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "ngram-hosts")
    claims = {v["persistentVolumeClaim"]["claimName"] for spec in (host["template"]["spec"], job["spec"]["template"]["spec"])
              for v in spec["volumes"]}
    assert claims == {pvc["metadata"]["name"]}
    (container,) = job["spec"]["template"]["spec"]["containers"]
    cache = {e["name"]: e["value"] for e in container["env"]}["DART_SERVE_CACHE"]
    host_env = host["template"]["spec"]["containers"][0]["env"]
    assert cache == {e["name"]: e.get("value") for e in host_env}["DART_SERVE_CACHE"]
    args = container["command"]
    assert args[:3] == ["python", "-m", "ngram_service.build"] and cluster["applications"][0]["args"]["ngram"]["trie"] == "auto"
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"DART_SERVE_CACHE": cache}):
        assert args[args.index("--output") + 1] == str(default_trie_path("SmolLM2-135M-Instruct", "default", 3))
    from ngram_service.build import _parser

    _parser().parse_args(args[3:])  # the Job's arguments are the builder's


# The fields of KubeRay's ray.io/v1 RayJob that k8s/trie-build-rayjob.yaml uses (rayjob_types.go of
# the same KubeRay line; the cluster spec is the RayService's rayClusterConfig above), closed as above.
KUBERAY_RAYJOB_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["entrypoint", "rayClusterSpec"],
            "properties": {
                "entrypoint": {"type": "string"},
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "ttlSecondsAfterFinished": _INT32,
                "activeDeadlineSeconds": _INT32,
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode"]},
                "rayClusterSpec": KUBERAY_RAYSERVICE_SCHEMA["properties"]["spec"]["properties"]["rayClusterConfig"],
            },
        },
    },
}


def test_the_ray_build_job_is_a_valid_rayjob_that_writes_onto_the_tries_volume():
    import shlex

    import jsonschema
    import kubernetes_validate

    from ngram_service.build import _parser
    from ngram_service.cache import default_trie_path

    (job,) = _manifests("trie-build-rayjob.yaml")
    jsonschema.validate(job, KUBERAY_RAYJOB_SCHEMA)
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == _docs()[1]["spec"]["rayClusterConfig"]["rayVersion"]
    head, (builders,) = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    for i, template in enumerate((head["template"], builders["template"])):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"b{i}"},
                                      "template": template}, K8S_VERSION, strict=True)
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "ngram_service.build"]
    args = _parser().parse_args(argv[3:])
    assert args.ray and args.address == "auto" and args.resume
    # the driver (on the head) writes onto the tries claim, where the n-gram host's cache is
    (pvc,) = _manifests("tries-pvc.yaml")
    (container,) = head["template"]["spec"]["containers"]
    (mount,) = container["volumeMounts"]
    (volume,) = head["template"]["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"] and volume["name"] == mount["name"]
    cache = {e["name"]: e["value"] for e in container["env"]}["DART_SERVE_CACHE"]
    assert args.output.startswith(mount["mountPath"] + "/")
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"DART_SERVE_CACHE": cache}):
        assert args.output == str(default_trie_path("SmolLM2-135M-Instruct", args.corpus, args.order))
    # reduce tasks spill on the builders' own scratch, which every builder mounts
    (worker,) = builders["template"]["spec"]["containers"]
    assert args.task_tmp_dir in {m["mountPath"] for m in worker["volumeMounts"]}
    assert head["rayStartParams"]["num-cpus"] == "0"  # tasks on the builders, the driver alone on the head


def test_the_dockerfile_builds_on_the_pinned_ray_image():
    text = (ROOT / "k8s" / "Dockerfile").read_text()
    _, service, _ = _docs()
    ray_version = service["spec"]["rayClusterConfig"]["rayVersion"]
    assert f"ARG RAY_IMAGE=rayproject/ray:{ray_version}-" in text and "FROM ${RAY_IMAGE}" in text
    assert "pip install --no-cache-dir --no-deps -r scripts/requirements-data.txt" in text  # as the README
    for copied in ("dart_core", "ngram_service", "deployments", "protos", "setup.py", "pyproject.toml"):
        assert f" {copied}" in text and (ROOT / copied).exists()


def _pods():
    """{group: pod template} of the RayService ("head" for the head group)."""
    config = _docs()[1]["spec"]["rayClusterConfig"]
    return {"head": config["headGroupSpec"]["template"]} | {g["groupName"]: g["template"]
                                                              for g in config["workerGroupSpecs"]}


def test_every_pod_takes_the_tokens_from_one_secret():
    """The n-gram token and the API key come from one Kubernetes Secret into every pod (the head,
    where the application is built and reads the token; the engines; the n-gram host), under the
    variable names the app's args read."""
    _, _, cluster = _docs()
    args = AppConfig.model_validate(cluster["applications"][0]["args"])
    for group, pod in _pods().items():
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        for var, key in ((args.ngram.auth_token_env, "ngram-token"), (args.api_key_env, "api-key")):
            assert env[var]["valueFrom"]["secretKeyRef"] == {"name": "dart-serve-secrets", "key": key,
                                                             "optional": True}, (group, var)


def test_the_network_policy_admits_only_engine_pods_to_the_ngram_port():
    """k8s/ngram-networkpolicy.yaml selects the n-gram host's pods by their template's labels, admits
    the engine pods (and only them) to args.ngram.port, and leaves every other port to the cluster's
    own pods (Ray's traffic); docs/kubernetes.md shows the same file."""
    (policy,) = _manifests("ngram-networkpolicy.yaml")
    _, _, cluster = _docs()
    port = cluster["applications"][0]["args"]["ngram"]["port"]
    labels = {group: pod["metadata"]["labels"] for group, pod in _pods().items()}

    def selected(selector):
        return {g for g, lab in labels.items() if selector["matchLabels"].items() <= lab.items()}

    spec = policy["spec"]
    assert selected(spec["podSelector"]) == {"ngram-hosts"} and spec["policyTypes"] == ["Ingress"]
    allowed: dict[int, set[str]] = {}
    for rule in spec["ingress"]:
        groups = set().union(*(selected(f["podSelector"]) for f in rule["from"]))
        for p in rule["ports"]:
            for n in (port - 1, port, port + 1, 1, 6379, 65535):
                if p["port"] <= n <= p.get("endPort", p["port"]):
                    allowed.setdefault(n, set()).update(groups)
    assert allowed[port] == {"gpu-engines"}
    assert all(allowed[n] == set(labels) for n in (port - 1, port + 1, 1, 6379, 65535))
    import re
    import textwrap

    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "kubernetes.md").read_text(), re.S)
    assert [yaml.safe_load(textwrap.dedent(b)) for b in blocks if "NetworkPolicy" in b] == [policy]
