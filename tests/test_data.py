"""data/: every dataset read offline from its real on-disk format, normalised, and batched."""
import pickle
import socket
import struct
import urllib.request

import numpy as np
import pytest
import torch

import data
from data import datasets

IDX_UBYTE = 0x08  # IDX type code of unsigned bytes


def write_idx(path, array):
    """An IDX file (the MNIST format): magic (0, 0, type, ndim), big-endian int32 sizes, raw bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">BBBB", 0, 0, IDX_UBYTE, array.ndim) + struct.pack(f">{array.ndim}i", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_tiny_mnist(root, folder="MNIST", num_train=12, num_val=6):
    """A tiny MNIST-format set under root/<folder>/raw; returns its (train, val) (images, labels)."""
    rng = np.random.default_rng(0)
    splits = {}
    for prefix, size in (("train", num_train), ("t10k", num_val)):
        images = rng.integers(0, 256, size=(size, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=size, dtype=np.uint8)
        write_idx(root / folder / "raw" / f"{prefix}-images-idx3-ubyte", images)
        write_idx(root / folder / "raw" / f"{prefix}-labels-idx1-ubyte", labels)
        splits[prefix] = images, labels
    return splits["train"], splits["t10k"]


def write_tiny_cifar10(root, per_batch=3):
    """A tiny CIFAR-10 set in its python-pickle batch format; returns its (train, val) (images, labels)."""
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    splits = {"train": [], "val": []}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        images = rng.integers(0, 256, size=(per_batch, 3, 32, 32), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 10, size=per_batch)]
        with open(folder / name, "wb") as file:  # rows are channel-major: 1024 red, 1024 green, 1024 blue
            pickle.dump({"data": images.reshape(per_batch, -1), "labels": labels}, file)
        splits["val" if name == "test_batch" else "train"].append((images, labels))
    return tuple(
        (np.concatenate([i for i, _ in batches]), np.concatenate([l for _, l in batches]))
        for batches in (splits["train"], splits["val"])
    )


def assert_normalised_copy(loaded, raw_train, raw_images, raw_labels):
    """`loaded` is raw_images scaled to [0, 1] and normalised by the raw training split's channel stats."""
    train = torch.tensor(raw_train, dtype=torch.float32) / 255
    if train.ndim == 3:
        train = train.unsqueeze(1)
    mean = train.mean(dim=(0, 2, 3), keepdim=True)
    std = train.std(dim=(0, 2, 3), keepdim=True)
    images = torch.tensor(raw_images, dtype=torch.float32) / 255
    if images.ndim == 3:
        images = images.unsqueeze(1)
    torch.testing.assert_close(loaded[0], (images - mean) / std)
    assert loaded[1].tolist() == [int(label) for label in raw_labels]


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_formats_read_from_idx_files_offline(tmp_path, name, folder):
    (train_images, train_labels), (val_images, val_labels) = write_tiny_mnist(tmp_path, folder)
    loaded = data.load_data(name, root=tmp_path)
    assert loaded.image_shape == (1, 28, 28) and loaded.num_classes == 10
    assert_normalised_copy((loaded.train_images, loaded.train_labels), train_images, train_images, train_labels)
    assert_normalised_copy((loaded.val_images, loaded.val_labels), train_images, val_images, val_labels)


def test_cifar10_reads_pickle_batches_offline(tmp_path):
    (train_images, train_labels), (val_images, val_labels) = write_tiny_cifar10(tmp_path)
    loaded = data.load_data("cifar10", root=tmp_path)
    assert loaded.image_shape == (3, 32, 32) and len(loaded.train_labels) == 15 and len(loaded.val_labels) == 3
    assert_normalised_copy((loaded.train_images, loaded.train_labels), train_images, train_images, train_labels)
    assert_normalised_copy((loaded.val_images, loaded.val_labels), train_images, val_images, val_labels)


@pytest.mark.parametrize("name, folder", [
    ("mnist", "MNIST/raw"), ("fashion_mnist", "FashionMNIST/raw"), ("cifar10", "cifar-10-batches-py"),
])
def test_missing_dataset_offline_names_the_folder_and_the_fix(tmp_path, name, folder):
    with pytest.raises(data.DataError) as error:
        data.load_data(name, root=tmp_path, download=False)
    message = str(error.value)
    assert "\n" not in message
    assert str(tmp_path / folder) in message and "data.download=true" in message


def test_partly_missing_dataset_lists_the_missing_files(tmp_path):
    write_tiny_mnist(tmp_path)
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(data.DataError, match="missing .*: t10k-labels-idx1-ubyte;"):
        data.load_data("mnist", root=tmp_path)


def test_failed_download_is_one_line_naming_the_folder(tmp_path):
    def offline_fetch():
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried https://example/, got:\n<no network>")

    with pytest.raises(data.DataError) as error:
        data.datasets.ensure_files(tmp_path / "MNIST" / "raw", ["train-images-idx3-ubyte"], True, offline_fetch)
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "MNIST" / "raw") in message and "<no network>" in message


def test_a_download_from_a_network_that_never_answers_times_out_in_one_line(tmp_path, monkeypatch):
    # a stalled proxy or firewall: the connection is taken, and no byte ever comes back
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        monkeypatch.setattr(datasets, "DOWNLOAD_TIMEOUT_S", 0.5)

        def fetch():  # as torchvision's download_url fetches: urlopen with no timeout of its own
            urllib.request.urlopen(f"http://127.0.0.1:{port}/train-images-idx3-ubyte.gz").read()

        with pytest.raises(data.DataError, match="download into .* failed .*timed out.*; without internet"):
            datasets.ensure_files(tmp_path, ["train-images-idx3-ubyte"], True, fetch)
    assert socket.getdefaulttimeout() is None  # put back as it was


def test_digits_split_is_fixed_and_disjoint():
    torch.manual_seed(123)  # the run's seed must not move the split
    first = data.load_data("digits", root="unused", val_fraction=0.2, split_seed=0)
    torch.manual_seed(456)
    second = data.load_data("digits", root="unused", val_fraction=0.2, split_seed=0)
    assert len(first.train_labels) + len(first.val_labels) == 1797 and len(first.val_labels) == 359
    assert torch.equal(first.val_images, second.val_images) and torch.equal(first.train_labels, second.train_labels)
    train_rows = {tuple(row.tolist()) for row in first.train_images.flatten(1)}
    assert not any(tuple(row.tolist()) in train_rows for row in first.val_images.flatten(1))
    assert first.train_images.mean().abs() < 1e-5 and (first.train_images.std() - 1).abs() < 0.02
    other = data.load_data("digits", root="unused", split_seed=1)
    assert not torch.equal(first.val_labels, other.val_labels)


def test_fake_data_of_any_shape_is_reproducible():
    first = data.load_data("fake", root="unused", train_size=6, val_size=4, image_size=[2, 5, 7], num_classes=3)
    second = data.load_data("fake", root="unused", train_size=6, val_size=4, image_size=[2, 5, 7], num_classes=3)
    assert first.train_images.shape == (6, 2, 5, 7) and first.val_images.shape == (4, 2, 5, 7)
    assert first.num_classes == 3 and set(first.train_labels.tolist()) <= {0, 1, 2}
    assert torch.equal(first.train_images, second.train_images)
    assert not torch.equal(first.train_images[:4], first.val_images)
    other_seed = data.load_data("fake", root="unused", train_size=6, val_size=4, image_size=[2, 5, 7], num_classes=3,
                                seed=1)
    assert not torch.equal(first.train_images, other_seed.train_images)
    # the validation split does not move when the training split grows
    raw = datasets.read_fake("unused", False, 6, 4, (2, 5, 7), 3)
    raw_bigger = datasets.read_fake("unused", False, 60, 4, (2, 5, 7), 3)
    assert torch.equal(raw[2], raw_bigger[2]) and torch.equal(raw[0], raw_bigger[0][:6])
    assert raw[0].min() >= 0 and raw[0].max() <= 1 and len(raw[0].unique()) > 100  # random pixels, not a pattern


def test_fake_data_takes_any_number_of_channels():
    assert data.load_data("fake", root="unused", train_size=2, val_size=2, image_size=[6, 4, 4]).image_shape == (6, 4, 4)


@pytest.mark.parametrize("kind", data.LOADER_KINDS)
def test_loaders_shuffle_every_epoch_and_cover_every_sample_once(kind):
    images = torch.arange(10, dtype=torch.float32).view(10, 1, 1, 1)
    labels = torch.arange(10)
    loader = data.make_loader(images, labels, batch_size=4, shuffle=True, kind=kind, device=torch.device("cpu"))
    epochs = [[batch_labels.tolist() for _, batch_labels in loader] for _ in range(2)]
    for batches in epochs:
        assert [len(b) for b in batches] == [4, 4, 2] and sorted(sum(batches, [])) == list(range(10))
    assert epochs[0] != epochs[1]
    for batch_images, batch_labels in loader:
        assert torch.equal(batch_images.flatten(), batch_labels.float())  # images travel with their labels
    again = data.make_loader(images, labels, batch_size=4, shuffle=True, kind=kind, device=torch.device("cpu"))
    assert [b.tolist() for _, b in again] == epochs[0]  # the order depends only on the seed


def test_in_memory_loader_keeps_order_without_shuffle():
    labels = torch.arange(7)
    loader = data.InMemoryLoader(labels.view(7, 1).float(), labels, batch_size=3, shuffle=False)
    assert len(loader) == 3
    assert [b.tolist() for _, b in loader] == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize("num_samples, batch_size", [(10, 4), (12, 4), (1, 8), (0, 3)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_batch_indices_cut_one_order_into_batches_and_deal_each_out_among_the_ranks(num_samples, batch_size, shuffle):
    def batches(rank=0, world_size=1):
        generator = torch.Generator().manual_seed(7)
        return [index.tolist() for index in data.loaders.batch_indices(num_samples, batch_size, shuffle, generator,
                                                                        rank, world_size)]

    alone = batches()
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(7)).tolist() if shuffle \
        else list(range(num_samples))
    assert alone == [order[start:start + batch_size] for start in range(0, num_samples, batch_size)]
    for world_size in (2, 3):
        shards = [batches(rank, world_size) for rank in range(world_size)]
        assert all(len(shard) == len(alone) for shard in shards)  # every rank steps as often
        for step, batch in enumerate(alone):
            assert [shard[step] for shard in shards] == [batch[rank::world_size] for rank in range(world_size)]


def test_in_memory_loader_yields_the_rows_and_labels_of_its_batches_in_a_seeded_order():
    images, labels = torch.arange(20.0).reshape(10, 2), torch.arange(10) * 10
    first, second = (list(data.InMemoryLoader(images, labels, batch_size=4, shuffle=True, seed=3)) for _ in range(2))
    assert [len(y) for _, y in first] == [4, 4, 2]
    seen = torch.cat([y for _, y in first])
    assert sorted(seen.tolist()) == labels.tolist()  # each sample once an epoch
    for (x, y), (x2, y2) in zip(first, second):
        assert torch.equal(x, images[y // 10]) and torch.equal(x, x2) and torch.equal(y, y2)


@pytest.mark.parametrize("num_samples, batch_size, min_last_batch, sizes", [
    (1438, 479, 1, [479, 479, 479, 1]),  # as cut: validation, and training a model without BatchNorm
    (1438, 479, 2, [479, 479, 480]),  # digits at batch 479 for a ResNet: the last sample joins the batch before
    (1439, 479, 2, [479, 479, 479, 2]),  # a last batch big enough stays
    (10, 4, 4, [4, 6]),  # 2 CPU processes of a ResNet: a last batch of 2 would give each 1 sample
    (1, 8, 2, [1]),  # one batch has none before it to join (build refuses it for BatchNorm)
    (4, 1, 2, [1, 1, 1, 1]),  # no smaller last batch (build refuses batch 1 for BatchNorm)
])
def test_a_last_batch_smaller_than_min_last_batch_joins_the_one_before(num_samples, batch_size, min_last_batch, sizes):
    batches = [index.tolist() for index in data.loaders.batch_indices(
        num_samples, batch_size, False, None, min_last_batch=min_last_batch)]
    assert [len(batch) for batch in batches] == sizes
    assert sum(batches, []) == list(range(num_samples))  # every sample once, in order
    assert data.loaders.batch_count(num_samples, batch_size, min_last_batch) == len(sizes)
    shards = [[index.tolist() for index in data.loaders.batch_indices(
        num_samples, batch_size, False, None, rank, 2, min_last_batch=min_last_batch)] for rank in (0, 1)]
    assert [shards[0][step] + shards[1][step] for step in range(len(sizes))] == \
        [batch[0::2] + batch[1::2] for batch in batches]  # the processes share the same batches


@pytest.mark.parametrize("kind", data.LOADER_KINDS)
def test_both_loaders_join_a_small_last_batch_and_count_it(kind):
    images, labels = torch.arange(9.0).view(9, 1, 1, 1), torch.arange(9)
    loader = data.make_loader(images, labels, 4, True, kind, torch.device("cpu"), min_last_batch=2)
    assert len(loader) == 2 and [len(y) for _, y in loader] == [4, 5]
    as_cut = data.make_loader(images, labels, 4, True, kind, torch.device("cpu"))
    assert len(as_cut) == 3 and [len(y) for _, y in as_cut] == [4, 4, 1]
