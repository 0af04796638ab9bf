"""The KubeRay RayService runs the same Serve application as deployments/dart.yaml."""

from __future__ import annotations

from pathlib import Path

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
        for key in ("max_ongoing_requests", "max_queued_requests"):
            assert ld[name].get(key) == cd[name].get(key), (name, key)


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
    settings, GPU engines, the n-gram service on the n-gram host with the target's tokenizer."""
    example = yaml.safe_load((ROOT / "deployments/dart-qwen3-reference.yaml").read_text())
    local = yaml.safe_load((ROOT / "deployments/dart.yaml").read_text())
    for key in ("proxy_location", "http_options", "grpc_options"):
        assert example[key] == local[key], key
    (app,) = example["applications"]
    assert app["import_path"] == local["applications"][0]["import_path"]
    cfg = AppConfig.model_validate(app["args"])
    assert (cfg.top_k, cfg.beam_width, cfg.context_weight) == (25, 20, 0.0)
    assert cfg.ngram.trie == "/models/dart-ngram" and cfg.ngram.tokenizer == cfg.model
    deps = {d["name"]: d for d in app["deployments"]}
    assert deps["DartEngine"]["ray_actor_options"]["num_gpus"] == 1
    assert deps["NgramService"]["ray_actor_options"]["resources"] == {"ngram_host": 1}
