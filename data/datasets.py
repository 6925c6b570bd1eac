"""Every dataset here fits in memory: it is read once into (N, C, H, W) tensors and normalised with the
per-channel mean and std of its training split. The official test split serves as validation set, except
for digits, which has none and is split with a fixed seed.
"""
import pickle
import socket
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torchvision

DIGITS_MAX_VALUE = 16  # load_digits' pixels are counts of set bits in 4x4 blocks: 0..16


class DataError(Exception):
    """A dataset that cannot be loaded; the message says where the files belong and how to get them."""


@dataclass
class ImageData:
    train_images: torch.Tensor  # float32 (N, C, H, W), normalised
    train_labels: torch.Tensor  # int64 (N,)
    val_images: torch.Tensor
    val_labels: torch.Tensor
    num_classes: int

    @property
    def image_shape(self):
        """(channels, height, width)."""
        return tuple(self.train_images.shape[1:])


def load_data(name, root, download=False, **options):
    """Load a dataset by name into memory; `options` are the dataset's own settings (see conf/data/).

    Example:
        >>> data = load_data("digits", root="~/.cache/linear_lab/datasets")
        >>> data.train_images.shape, data.num_classes
        (torch.Size([1438, 1, 8, 8]), 10)
    """
    if name not in READERS:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(READERS)}")
    train_images, train_labels, val_images, val_labels, num_classes = READERS[name](
        root=Path(root).expanduser(), download=download, **options
    )
    mean = train_images.mean(dim=(0, 2, 3), keepdim=True)
    std = train_images.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)  # a constant channel stays finite
    return ImageData(
        train_images=(train_images - mean) / std,
        train_labels=train_labels,
        val_images=(val_images - mean) / std,
        val_labels=val_labels,
        num_classes=num_classes,
    )


def read_digits(root, download, val_fraction=0.2, split_seed=0):
    """scikit-learn's 1,797 8x8 handwritten digits (bundled with it, no network), split train/val."""
    # imported here, not at the top: scikit-learn brings SciPy, its OpenBLAS and a second OpenMP runtime into
    # the process and takes 0.66 s to import (Zen 5), for the digits alone
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / DIGITS_MAX_VALUE
    labels = torch.tensor(digits.target, dtype=torch.int64)
    # its own generator: the split stays the same whatever the run's seed
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    num_val = round(len(labels) * val_fraction)
    if not 0 < num_val < len(labels):
        raise DataError(f"data.val_fraction={val_fraction} leaves {num_val} of the {len(labels)} digits for "
                        "validation and the rest for training; each needs at least one (0.2 is the default)")
    val, train = order[:num_val], order[num_val:]
    return images[train], labels[train], images[val], labels[val], 10


def read_mnist(dataset_class, root, download):
    """MNIST or Fashion-MNIST from the IDX files in <root>/<MNIST|FashionMNIST>/raw/."""
    folder = root / dataset_class.__name__ / "raw"
    file_names = [Path(url).name.removesuffix(".gz") for url, _ in dataset_class.resources]
    ensure_files(folder, file_names, download, lambda: dataset_class(root, train=True, download=True))
    splits = [dataset_class(root, train=train) for train in (True, False)]
    images = [split.data.unsqueeze(1).float() / 255 for split in splits]
    return images[0], splits[0].targets, images[1], splits[1].targets, len(splits[0].classes)


def read_cifar10(root, download):
    """CIFAR-10 from its python-pickle batches in <root>/cifar-10-batches-py/.

    The batches are read here rather than through torchvision's CIFAR10, which refuses any file whose
    checksum differs from the official one (and so any smaller set in the same format).
    """
    folder = root / torchvision.datasets.CIFAR10.base_folder
    train_files = [name for name, _ in torchvision.datasets.CIFAR10.train_list]
    val_files = [name for name, _ in torchvision.datasets.CIFAR10.test_list]
    ensure_files(
        folder, train_files + val_files, download, lambda: torchvision.datasets.CIFAR10(root, download=True)
    )

    def read_batches(names):
        batches = []
        for name in names:
            with open(folder / name, "rb") as file:
                batches.append(pickle.load(file, encoding="latin1"))
        images = np.concatenate([batch["data"] for batch in batches]).reshape(-1, 3, 32, 32)
        labels = np.concatenate([batch["labels"] for batch in batches])
        return torch.from_numpy(images).float() / 255, torch.from_numpy(labels).long()

    return *read_batches(train_files), *read_batches(val_files), 10


def read_fake(root, download, train_size=1024, val_size=256, image_size=(3, 32, 32), num_classes=10, seed=0):
    """Random images of any (channels, height, width) with random labels, as torchvision's FakeData makes them,
    but drawn as tensors at once (MNIST's size in well under a second; FakeData draws a PIL image at a time,
    about 20 s) and from `seed`, so that a run's fake data is the same every time."""

    def draw(size, generator):
        images = torch.randint(0, 256, (size, *image_size), dtype=torch.uint8, generator=generator)
        labels = torch.randint(0, num_classes, (size,), generator=generator)
        return images.float() / 255, labels

    # one generator per split: the validation images do not depend on how many training images there are
    train, val = (torch.Generator().manual_seed(seed * 2 + split) for split in (0, 1))
    return *draw(train_size, train), *draw(val_size, val), num_classes


DOWNLOAD_TIMEOUT_S = 60  # a connection or read that waits longer for the server fails the download


def ensure_files(folder, file_names, download, fetch):
    """Fetch missing files when download is on; otherwise fail with one line naming the folder."""
    missing = [name for name in file_names if not (folder / name).is_file()]
    if missing and download:
        timeout_s = socket.getdefaulttimeout()
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # torchvision's fetch has none: a silent network hung it
        try:
            fetch()
        except Exception as error:  # network errors come in many types; all end the run the same way
            reason = " ".join(str(error).split())  # torchvision's reasons span lines; ours is one
            message = f"download into {folder} failed ({reason}); without internet, copy the files there"
            raise DataError(message) from error
        finally:
            socket.setdefaulttimeout(timeout_s)
        missing = [name for name in file_names if not (folder / name).is_file()]
    if missing:
        raise DataError(
            f"dataset files missing in {folder}: {', '.join(missing)}; "
            "run with data.download=true (needs internet) or copy them there (data.root sets the folder)"
        )


READERS = {
    "digits": read_digits,
    "mnist": partial(read_mnist, torchvision.datasets.MNIST),
    "fashion_mnist": partial(read_mnist, torchvision.datasets.FashionMNIST),
    "cifar10": read_cifar10,
    "fake": read_fake,
}
DATASET_NAMES = tuple(READERS)
