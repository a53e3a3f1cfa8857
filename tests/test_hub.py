"""Hugging Face Hub model names in recipes (`model.hf_path: ORG/NAME`, `data.tokenizer`), resolved
through huggingface_hub's local cache, and `fsdprun download`.

The cache is built in each test as huggingface_hub lays it out (models--ORG--NAME/blobs,
refs/main, snapshots/<revision>/ with links into blobs), from the tiny HuggingFace folder the
recipes ship. Nothing here reaches a network: the commands run with HF_HUB_OFFLINE=1 and an
endpoint nothing listens on; a download is huggingface_hub's `snapshot_download` replaced by one
that fills the cache. Run with `pytest tests/test_hub.py`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import FSDPRUN, fsdprun_env, run_fsdprun

from fsdprun.config import hub
from fsdprun.errors import UserError

TINY = Path(__file__).resolve().parents[1] / "recipes" / "data" / "tiny-llama-hf"
HUB_ID = "tiny-org/tiny-llama"


def hub_cache(cache: Path, hub_id: str = HUB_ID, files: list[str] | None = None) -> Path:
    """Lay `files` of the tiny folder (default all) out as huggingface_hub caches `hub_id`;
    returns the snapshot folder."""
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    revision = hashlib.sha1(hub_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in sorted(TINY.iterdir()):
        if files is not None and path.name not in files:
            continue
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def hub_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return fsdprun_env(
        HF_HOME=str(tmp_path / "hf-home"), HF_HUB_CACHE=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9", HF_TOKEN="", **extra,
    )  # fmt: skip


def fsdprun(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    # The read-only commands load no torch: a plain subprocess is as fast as the zygote.
    return subprocess.run(
        [FSDPRUN, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def hub_recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "hub.yaml"
    recipe.write_text(
        f"extends: sft-demo\nmodel:\n  hf_path: {HUB_ID}\ndata:\n  tokenizer: {HUB_ID}\n"
    )
    return recipe


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(tmp_path):
    snapshot = hub_cache(tmp_path / "cache")
    env = hub_env(tmp_path)
    # In a recipe file (not a folder beside it), and as a command-line override. (debug: its
    # config check reads no tokenizer, so the command loads neither torch nor transformers.)
    recipe = tmp_path / "hub.yaml"
    recipe.write_text(f"extends: debug\nmodel:\n  hf_path: {HUB_ID}\n")
    for args in ([str(recipe)], ["debug", f"model.hf_path={HUB_ID}"]):
        proc = fsdprun("config", *args, "--explain", env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        [line] = [line for line in proc.stdout.splitlines() if line.strip().startswith("hf_path")]
        assert f"hf_path: {snapshot}" in line and f"Hub id {HUB_ID}" in line, line
    # download finds it cached: no network asked.
    proc = fsdprun("download", HUB_ID, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{HUB_ID}: {snapshot}"


def test_a_hub_id_not_cached_is_one_line_before_launch(tmp_path):
    env = hub_env(tmp_path)
    missing = "nobody/no-model"
    for command in (["config", "debug"], ["train", "debug"], ["plan", "debug"]):
        proc = fsdprun(*command, f"model.hf_path={missing}", env=env, cwd=tmp_path)
        line = one_line_error(proc)
        assert line.startswith(f"error: model.hf_path: '{missing}' is no folder here and not in "
                               f"the Hugging Face cache ({tmp_path / 'cache'})"), line  # fmt: skip
        assert "HF_HUB_OFFLINE is set" in line and f"`fsdprun download {missing}`" in line
        # Only a command that downloads would download with HF_HUB_OFFLINE unset.
        assert ("unset HF_HUB_OFFLINE to download it here" in line) == (command[0] == "train")
    assert not (tmp_path / "runs").exists()
    # `fsdprun download` itself names what to change here, not `fsdprun download` again: offline,
    # HF_HUB_OFFLINE; without a network (nothing listens at HF_ENDPOINT), the network.
    copy = "copy its folder models--nobody--no-model from the cache of a machine that has it into "
    online = {k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"}
    for more in ([], ["--tokenizer-only"]):
        line = one_line_error(fsdprun("download", missing, *more, env=env, cwd=tmp_path))
        assert line.startswith(f"error: '{missing}': not in the Hugging Face cache"), line
        assert "unset HF_HUB_OFFLINE" in line and f"{copy}{tmp_path / 'cache'}" in line, line
        assert "fsdprun download" not in line and "hf_path" not in line, line
        line = one_line_error(fsdprun("download", missing, *more, env=online, cwd=tmp_path))
        assert line.startswith(f"error: '{missing}': cannot download from the Hugging Face Hub "
                               "at http://127.0.0.1:9 ("), line  # fmt: skip
        assert "where the Hub is reachable" in line and copy in line, line
        assert "fsdprun download" not in line and "tokenizer" not in line, line
    # Online, the read-only commands still only look in the cache.
    line = one_line_error(fsdprun("config", "debug", f"data.tokenizer={missing}", env=online,
                                  cwd=tmp_path))  # fmt: skip
    assert "this command never downloads" in line
    # A snapshot without the weights serves a tokenizer but not a model.
    hub_cache(
        tmp_path / "cache",
        "tok-org/only-tokenizer",
        files=["tokenizer.json", "tokenizer_config.json"],
    )
    ok = fsdprun("config", "debug", "data.tokenizer=tok-org/only-tokenizer", env=env,
                 cwd=tmp_path)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    # A download cut short of the weights: named as such (it is in the cache), by every
    # command; tune before it makes its --out.
    hub_cache(tmp_path / "cache", "cut-org/no-weights",
              files=["config.json", "tokenizer.json", "tokenizer_config.json"])  # fmt: skip
    tune = ["tune", "debug", "--out", str(tmp_path / "t"), "--device-memory", "1GB"]
    for command in (["config", "debug"], tune):
        line = one_line_error(fsdprun(*command, "model.hf_path=cut-org/no-weights", env=env,
                                      cwd=tmp_path))  # fmt: skip
        assert line.startswith("error: model.hf_path: the cached snapshot of cut-org/no-weights "
                               "has no weight files (model.safetensors or "
                               "model.safetensors.index.json)"), line  # fmt: skip
        assert "HF_HUB_OFFLINE is set" in line and "fsdprun download cut-org/no-weights" in line
    assert not (tmp_path / "t").exists()


def test_a_local_folder_named_like_an_id_stays_a_folder(tmp_path, monkeypatch):
    from fsdprun.config import load_recipe

    shutil.copytree(TINY, tmp_path / "org" / "model")
    monkeypatch.chdir(tmp_path)
    cfg = load_recipe("sft-demo", ["model.hf_path=org/model"]).config
    assert cfg.model.hf_path == str(tmp_path / "org" / "model")


def test_train_from_a_hub_id_offline(tmp_path):
    snapshot = hub_cache(tmp_path / "cache")
    run_dir = tmp_path / "run"
    proc = run_fsdprun(
        "train", str(hub_recipe(tmp_path)), "train.steps=2", "eval.every_steps=0",
        "--nproc-per-node", "1", "--run-dir", str(run_dir), cwd=tmp_path, env=hub_env(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "final loss" in proc.stdout
    # The run records the snapshot it read: a resume reads the same revision.
    recorded = (run_dir / "recipe.yaml").read_text()
    assert f"hf_path: {snapshot}" in recorded and f"tokenizer: {snapshot}" in recorded


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """huggingface_hub pointed at an empty cache in tmp_path, online, with `snapshot_download`
    replaced: its downloads (calls without local_files_only) are recorded and fill the cache,
    or raise what the test sets."""
    import huggingface_hub
    from huggingface_hub import constants

    cache = tmp_path / "cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "_offline", lambda: False)
    real = huggingface_hub.snapshot_download
    state = {"downloads": [], "raise": None}

    def snapshot_download(repo_id, **kw):
        if kw.get("local_files_only"):
            return real(repo_id, cache_dir=str(cache), **kw)
        state["downloads"].append((repo_id, kw))
        if state["raise"] is not None:
            raise state["raise"]
        return str(hub_cache(cache, repo_id))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return state


def test_download_goes_through_snapshot_download_once(fake_hub, tmp_path):
    folder = hub.hub_folder(HUB_ID, key="model.hf_path", mode="download")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    [(repo, kw)] = fake_hub["downloads"]
    assert repo == HUB_ID
    assert "*.safetensors" in kw["allow_patterns"] and kw["ignore_patterns"] == ["original/*"]
    assert "tqdm_class" not in kw  # huggingface_hub's own progress bars
    # Cached now: no second download.
    assert hub.hub_folder(HUB_ID, key="model.hf_path", mode="download") == folder
    assert len(fake_hub["downloads"]) == 1


def _http_error(cls, status: int, text: str):
    import httpx2

    request = httpx2.Request("GET", f"https://huggingface.co/api/models/{HUB_ID}")
    return cls(text, response=httpx2.Response(status, request=request))


def test_a_gated_model_without_a_token_names_the_fix(fake_hub):
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    fake_hub["raise"] = _http_error(GatedRepoError, 401, "Access to model is restricted.\nMore")
    with pytest.raises(UserError) as e:
        hub.hub_folder(HUB_ID, key="model.hf_path", mode="download")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"model.hf_path: '{HUB_ID}' is a gated model: accept its license")
    assert "`hf auth login` (huggingface-cli login) or set HF_TOKEN" in message
    fake_hub["raise"] = _http_error(RepositoryNotFoundError, 404, "Repository Not Found")
    with pytest.raises(UserError, match="is not a model on the Hugging Face Hub"):
        hub.hub_folder(HUB_ID, key="data.tokenizer", mode="download")


def test_the_other_ranks_of_a_node_wait_for_local_rank_0(fake_hub, tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "WAIT_POLL_S", 0.05)
    assert hub.hub_mode_of_worker({"LOCAL_RANK": "0"}) == "download"
    assert hub.hub_mode_of_worker({"LOCAL_RANK": "3"}) == "wait"
    writer = threading.Timer(0.5, lambda: hub_cache(tmp_path / "cache"))
    writer.start()
    start = time.monotonic()
    folder = hub.hub_folder(HUB_ID, key="model.hf_path", mode="wait", wait_s=30)
    writer.join()
    assert time.monotonic() - start >= 0.4 and (folder / "config.json").is_file()
    assert fake_hub["downloads"] == []  # waiting ranks never download
    with pytest.raises(UserError, match="did not appear in the Hugging Face cache"):
        hub.hub_folder("nobody/late", key="model.hf_path", mode="wait", wait_s=0.2)


def test_the_tokenizer_and_chat_template_resolve_as_the_model_does(fake_hub, tmp_path):
    # data.tokenizer (sft-demo's chat template lives in its tokenizer_config.json) from the cache.
    from fsdprun.config import load_recipe

    snapshot = hub_cache(tmp_path / "cache")
    resolved = load_recipe("sft-demo", [f"data.tokenizer={HUB_ID}"], check=False)
    assert resolved.config.data.tokenizer == str(snapshot)
    assert "chat_template" in (snapshot / "tokenizer_config.json").read_text()
    assert resolved.provenance["data.tokenizer"] == f"command line, Hub id {HUB_ID}"
    assert fake_hub["downloads"] == []
