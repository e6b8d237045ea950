"""Checkpoints kept in a storage (lilo.storage): a directory or an S3-compatible server on loopback (moto, see
benchmarks/s3_server.py), reached through pyarrow's real clients. Two backends with separate node directories stand for
trainers on two nodes: what one saves, the other lists, loads and samples from the storage alone."""

import copy
import shutil

import pytest
import torch

from lilo.backend.checkpoints import stored
from lilo.backend.checkpoints.index import checkpoint_files, delete_checkpoint, list_checkpoints, read_checkpoint_file
from lilo.backend.paging.files import find_page_files
from lilo.backend.paging.mirror import PageMirror
from lilo.backend.paging.store import read_page_file
from lilo.backend.torch_backend import TorchBackend
from lilo.backend.types import LoadRequest, LoraSpec
from lilo.engine.commands import Command, Kind
from lilo.errors import NotFoundError
from lilo.storage import Storage, StorageError, redacted
from benchmarks.s3_server import S3Server
from test_sampler_checkpoints import greedy, save_for_sampler, train
from test_torch_backend import save

RUN = "s:train:0"


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(params=["directory", "s3"])
def storage(request, tmp_path):
    if request.param == "directory":
        return Storage(tmp_path / "shared")
    return Storage(request.getfixturevalue("s3").uri(tmp_path.name))


def node(base, storage: Storage, directory) -> TorchBackend:
    """A trainer's backend on a node whose own checkpoint copies are in ``directory``."""
    return TorchBackend(copy.deepcopy(base), max_adapters=3, max_rank=8, checkpoint_dir=directory,
                        storage=storage.child("checkpoints"))


def test_a_tree_is_stored_whole_and_fetched_whole(storage, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    for name, data in {"a.bin": b"0123456789", "b.bin": b"xyz", "marker": b"{}"}.items():
        (local / name).write_bytes(data)
    storage.upload_tree(local, "run/kind/one", "marker")
    assert set(storage.files("run/kind/one")) == {"a.bin", "b.bin", "marker"}
    assert set(storage.tree("run")) == {"kind/one/a.bin", "kind/one/b.bin", "kind/one/marker"}
    assert storage.read("run/kind/one/a.bin", 3, 4) == b"3456" and storage.read("run/kind/one/b.bin") == b"xyz"
    # Stored again with a file fewer: the stale file goes, the rest is replaced.
    (local / "b.bin").unlink()
    (local / "a.bin").write_bytes(b"new")
    storage.upload_tree(local, "run/kind/one", "marker")
    fetched = tmp_path / "fetched" / "one"
    storage.download_tree("run/kind/one", fetched, "marker")
    assert sorted(path.name for path in fetched.iterdir()) == ["a.bin", "marker"]
    assert (fetched / "a.bin").read_bytes() == b"new"
    storage.delete_tree("run/kind/one", "marker")
    assert storage.files("run/kind/one") == {} and storage.tree("run") == {}
    with pytest.raises(FileNotFoundError):
        storage.download_tree("run/kind/one", fetched, "marker")


def test_what_one_node_saves_another_lists_loads_and_samples_from_the_storage_alone(base, storage, tmp_path):
    writer = node(base, storage, tmp_path / "node-a")
    writer.add_adapter(RUN, LoraSpec(rank=4, seed=1))
    train(writer, RUN, seed=0)
    weights = save(writer, RUN, 3, "step-1")
    sampler = save_for_sampler(writer, RUN, "step-1")
    expected = greedy(writer, sampler)
    shutil.rmtree(tmp_path / "node-a")  # the writer's node is gone: only the storage has them

    reader = node(base, storage, tmp_path / "node-b")
    listed = list_checkpoints(reader.checkpoints.storage, RUN)
    assert {entry.tinker_path for entry in listed} == {weights, sampler}
    files = checkpoint_files(reader.checkpoints.storage, sampler)
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    assert read_checkpoint_file(reader.checkpoints.storage, sampler, "adapter_config.json", 0, 1 << 20).startswith(b"{")
    assert greedy(reader, sampler) == expected
    reader.add_adapter("copy", LoraSpec(rank=4, seed=9))
    reader.load_checkpoint(Command("copy", 1, Kind.LOAD_WEIGHTS, "copy:1", payload=LoadRequest(weights)))
    assert greedy(reader, "copy") == expected
    # Deleted from the storage: gone for every node, whatever copy one keeps.
    delete_checkpoint(reader.checkpoints.storage, RUN, "sampler_weights/step-1")
    assert [entry.tinker_path for entry in list_checkpoints(reader.checkpoints.storage, RUN)] == [weights]
    with pytest.raises(NotFoundError):
        node(base, storage, tmp_path / "node-c").sampler_version(sampler)


def test_a_checkpoint_saved_again_on_one_node_is_fetched_again_by_another(base, storage, tmp_path, monkeypatch):
    monkeypatch.setattr(stored, "RECHECK_S", 0.0)
    writer, reader = node(base, storage, tmp_path / "a"), node(base, storage, tmp_path / "b")
    writer.add_adapter(RUN, LoraSpec(rank=4, seed=1))
    train(writer, RUN, seed=0)
    path = save_for_sampler(writer, RUN, "latest")
    first = greedy(reader, path)
    train(writer, RUN, seed=1)
    train(writer, RUN, seed=2)
    save_for_sampler(writer, RUN, "latest")
    assert greedy(reader, path) == greedy(writer, path) != first


def test_an_upload_that_fails_fails_the_save_with_a_message_and_leaves_it_unlisted(base, s3, tmp_path):
    storage = Storage(s3.uri(tmp_path.name))
    writer = node(base, storage, tmp_path / "a")
    writer.add_adapter(RUN, LoraSpec(rank=4, seed=1))
    s3.stop()  # a real outage: the server is gone while the save uploads
    try:
        with pytest.raises(StorageError, match="could not be stored, so it is not saved and not listed"):
            save(writer, RUN, 1, "lost")
    finally:
        s3.restart()
    assert list_checkpoints(writer.checkpoints.storage, RUN) == []
    with pytest.raises(NotFoundError):
        writer.sampler_version(f"tinker://{RUN}/sampler_weights/lost")
    assert save(writer, RUN, 2, "kept") == f"tinker://{RUN}/weights/kept"  # the storage is back: saves work again
    assert [entry.name for entry in list_checkpoints(writer.checkpoints.storage, RUN)] == ["kept"]


def test_a_storage_uri_is_shown_without_its_credentials_or_options():
    uri = "s3://key:secret@bucket/prefix?endpoint_override=127.0.0.1:9000&secret_key=x"
    assert redacted(uri) == "s3://bucket/prefix" and "secret" not in repr(Storage("/tmp/x"))
    with pytest.raises(StorageError, match="is not a storage lilo can open"):
        Storage("nosuchscheme://bucket/prefix")


def test_the_default_storage_is_the_directory_itself(base, tmp_path):
    backend = TorchBackend(copy.deepcopy(base), max_adapters=2, max_rank=8, checkpoint_dir=tmp_path)
    assert not backend.checkpoints.remote
    backend.add_adapter(RUN, LoraSpec(rank=4, seed=1))
    path = save(backend, RUN, 1, "here")
    assert (tmp_path / RUN / "weights" / "here" / "meta.json").is_file()
    assert torch.is_tensor(backend.bank.weights) and path.endswith("/weights/here")


def test_page_files_are_mirrored_to_the_storage_and_another_node_restores_from_them(base, storage, tmp_path):
    pages = storage.child("pages")
    trainer = TorchBackend(copy.deepcopy(base), max_adapters=1, max_rank=8, checkpoint_dir=tmp_path / "a" / "ckpt",
                           page_dir=tmp_path / "a" / "pages" / "trainer-0", page_storage=pages,
                           disk_adapter_bytes=1 << 24)
    trainer.add_adapter("paged", LoraSpec(rank=4, seed=1))
    train(trainer, "paged", seed=0)
    trainer.make_room(["other"], (), ())  # "paged" leaves its slot for the disk tier: its page file is written
    trainer.pages.mirror.flush()
    assert list(pages.tree("")) == ["trainer-0/paged.page.safetensors"]
    written = trainer.pages.peek("paged")

    # Another node pulls the stored file and finds it where it finds page files.
    other = PageMirror(pages, tmp_path / "b" / "pages")
    (pulled,) = other.pull("paged")
    (found,) = find_page_files(tmp_path / "b" / "pages", "paged")
    assert found.path == pulled and torch.equal(read_page_file(found).data, written.data)
    other.close()

    trainer.make_room(["paged"], (), ())  # paged back in: its page file goes, on this node and in the storage
    trainer.pages.mirror.flush()
    assert pages.tree("") == {}



def test_an_object_store_signs_urls_that_read_a_file_without_credentials_and_a_directory_does_not(s3, tmp_path):
    import httpx

    storage = Storage(s3.uri(tmp_path.name)).child("checkpoints")
    storage.write("run/external_weights/w/adapter_config.json", b'{"r": 4}')
    url = storage.signed_url("run/external_weights/w/adapter_config.json", 60)
    assert url.startswith(f"http://127.0.0.1:{s3.port}/{s3.bucket}/") and "testing" not in url.split("?")[0]
    # (moto checks no signatures, so a tampered URL cannot be shown refused here; S3 itself refuses it.)
    assert "X-Amz-Signature=" in url and "X-Amz-Expires=60" in url
    assert httpx.get(url).content == b'{"r": 4}'
    assert Storage(tmp_path / "shared").signed_url("run/x", 60) is None


def test_a_deleted_checkpoint_is_forgotten_by_the_node_that_held_a_copy(base, s3, tmp_path):
    storage = Storage(s3.uri(tmp_path.name))
    writer = node(base, storage, tmp_path / "a")
    writer.add_adapter(RUN, LoraSpec(rank=4, seed=1))
    path = save_for_sampler(writer, RUN, "gone")
    writer.sampler_version(path)  # fetched, and checked just now
    delete_checkpoint(writer.checkpoints.storage, RUN, "sampler_weights/gone")
    writer.checkpoints.forget(path)
    with pytest.raises(NotFoundError):  # asked again at once, not after the recheck interval
        writer.sampler_version(path)
