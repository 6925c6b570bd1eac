"""Batches for the training loop: straight from tensors on the device, or through torch's DataLoader."""
import torch
from torch.utils.data import DataLoader, TensorDataset

LOADER_KINDS = ("memory", "dataloader")


class InMemoryLoader:
    """Yields (images, labels) batches indexed from tensors already on the training device.

    Each pass draws a fresh shuffled order from its own generator, so the data order depends only on the
    seed. No worker processes and no per-batch copies between devices: at batch 128 that overhead would
    cost as much as the model's matrix products.

    Example:
        >>> loader = InMemoryLoader(images, labels, batch_size=128, shuffle=True, seed=0)
        >>> for batch_images, batch_labels in loader: ...
    """

    def __init__(self, images, labels, batch_size, shuffle, seed=0):
        self.images, self.labels = images, labels
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self):
        return -(-len(self.labels) // self.batch_size)

    def __iter__(self):
        if self.shuffle:
            order = torch.randperm(len(self.labels), generator=self.generator).to(self.images.device)
            for start in range(0, len(order), self.batch_size):
                index = order[start : start + self.batch_size]
                yield self.images[index], self.labels[index]
        else:
            for start in range(0, len(self.labels), self.batch_size):
                yield self.images[start : start + self.batch_size], self.labels[start : start + self.batch_size]


def make_loader(images, labels, batch_size, shuffle, kind, device, num_workers=0, seed=0):
    """A loader of the given kind ("memory" or "dataloader") over CPU tensors `images`, `labels`.

    "memory" moves the tensors to `device` once; "dataloader" leaves them on the CPU and the training
    loop moves each batch.

    Example:
        >>> loader = make_loader(data.train_images, data.train_labels, 128, True, "memory", torch.device("cpu"))
    """
    if kind == "memory":
        return InMemoryLoader(images.to(device), labels.to(device), batch_size, shuffle, seed)
    if kind == "dataloader":
        return DataLoader(
            TensorDataset(images, labels),
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
            pin_memory=device.type == "cuda",
            generator=torch.Generator().manual_seed(seed),
            persistent_workers=num_workers > 0,
        )
    raise ValueError(f"unknown loader {kind!r}; choose one of {', '.join(LOADER_KINDS)}")
