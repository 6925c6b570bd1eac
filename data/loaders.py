"""Batches for the training loop: straight from tensors on the device, or through torch's DataLoader."""
import torch
from torch.utils.data import DataLoader, TensorDataset

LOADER_KINDS = ("memory", "dataloader")


def batch_count(num_samples, batch_size, min_last_batch=1):
    """How many batches batch_indices cuts `num_samples` into."""
    count = -(-num_samples // batch_size)
    if count > 1 and num_samples - (count - 1) * batch_size < min(min_last_batch, batch_size):
        count -= 1
    return count


def batch_indices(
    num_samples, batch_size, shuffle, generator, rank=0, world_size=1, device=None, min_last_batch=1
):
    """Index tensors of one epoch's batches for process `rank` of `world_size` (torchrun's ranks).

    The order (drawn from `generator` when shuffling, else 0..num_samples-1) is cut into batches of
    `batch_size`, and each batch is dealt out: process r takes every world_size-th index from the r-th.
    Together the processes take exactly the batches one process would take alone, in the same order.
    A last batch smaller than the others and of fewer than `min_last_batch` samples joins the one before
    it: every sample still trains once an epoch, and BatchNorm never gets a step of 1 sample, which it
    cannot train on (trainer.build.min_training_batch).

    Example:
        >>> [index.tolist() for index in batch_indices(5, 4, False, None, rank=1, world_size=2)]
        [[1, 3], []]
        >>> [index.tolist() for index in batch_indices(5, 4, False, None, min_last_batch=2)]
        [[0, 1, 2, 3, 4]]
    """
    order = torch.randperm(num_samples, generator=generator) if shuffle else torch.arange(num_samples)
    order = order.to(device)
    # one split an epoch rather than slicing each batch out: the MLP's epoch about 1% faster
    # (bench/README.md, "Where the MLP step's time goes"); split makes one empty batch of no samples
    batches = order.split(batch_size) if num_samples else ()
    if len(batches) > 1 and len(batches[-1]) < min(min_last_batch, batch_size):  # only a smaller last batch
        batches = (*batches[:-2], order[(len(batches) - 2) * batch_size:])
    for batch in batches:
        yield batch[rank::world_size] if world_size > 1 else batch


class InMemoryLoader:
    """Yields (images, labels) batches indexed from tensors already on the training device.

    Each pass draws a fresh shuffled order from its own generator, so the data order depends only on the
    seed. No worker processes and no per-batch copies between devices: at batch 128 that overhead would
    cost as much as the model's matrix products. Under torchrun each rank gets its share of every batch
    (batch_indices).

    Example:
        >>> loader = InMemoryLoader(images, labels, batch_size=128, shuffle=True, seed=0)
        >>> for batch_images, batch_labels in loader: ...
    """

    def __init__(self, images, labels, batch_size, shuffle, seed=0, rank=0, world_size=1, min_last_batch=1):
        self.images, self.labels = images, labels
        self.batch_size, self.min_last_batch = batch_size, min_last_batch
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(seed)
        self.rank, self.world_size = rank, world_size

    def __len__(self):
        return batch_count(len(self.labels), self.batch_size, self.min_last_batch)

    def __iter__(self):
        for index in batch_indices(
            len(self.labels), self.batch_size, self.shuffle, self.generator, self.rank, self.world_size,
            self.images.device, self.min_last_batch,
        ):
            # index_select rather than images[index]: 11 instead of 63 us for a batch of 128
            # MNIST images here (2 threads), the same copy.
            yield self.images.index_select(0, index), self.labels.index_select(0, index)


class ShardedBatchSampler:
    """batch_indices as lists, for torch's DataLoader (its batch_sampler)."""

    def __init__(self, num_samples, batch_size, shuffle, generator, rank, world_size, min_last_batch=1):
        self.num_samples, self.batch_size, self.shuffle = num_samples, batch_size, shuffle
        self.generator, self.rank, self.world_size = generator, rank, world_size
        self.min_last_batch = min_last_batch

    def __len__(self):
        return batch_count(self.num_samples, self.batch_size, self.min_last_batch)

    def __iter__(self):
        for index in batch_indices(
            self.num_samples, self.batch_size, self.shuffle, self.generator, self.rank, self.world_size,
            min_last_batch=self.min_last_batch,
        ):
            yield index.tolist()


def make_loader(images, labels, batch_size, shuffle, kind, device, num_workers=0, seed=0, rank=0, world_size=1,
                min_last_batch=1):
    """A loader of the given kind ("memory" or "dataloader") over CPU tensors `images`, `labels`.

    "memory" moves the tensors to `device` once; "dataloader" leaves them on the CPU and the training
    loop moves each batch. With world_size > 1 (torchrun) each of the `batch_size` batches is shared out
    among the processes and this one, `rank`, gets its part. A last batch of fewer than `min_last_batch`
    samples joins the one before it (batch_indices).

    Example:
        >>> loader = make_loader(data.train_images, data.train_labels, 128, True, "memory", torch.device("cpu"))
    """
    if kind == "memory":
        return InMemoryLoader(
            images.to(device), labels.to(device), batch_size, shuffle, seed, rank, world_size, min_last_batch
        )
    if kind == "dataloader":
        order = torch.Generator().manual_seed(seed)
        return DataLoader(
            TensorDataset(images, labels),
            batch_sampler=ShardedBatchSampler(
                len(labels), batch_size, shuffle, order, rank, world_size, min_last_batch
            ),
            num_workers=num_workers,
            pin_memory=device.type == "cuda",
            # The workers' seeds come from a generator of their own: drawn from the order's, they would
            # shift the data order by how many iterators were made (one per epoch without workers, one per
            # process with persistent workers), so num_workers and a resume would change the run.
            generator=torch.Generator().manual_seed(seed),
            persistent_workers=num_workers > 0,
        )
    raise ValueError(f"unknown loader {kind!r}; choose one of {', '.join(LOADER_KINDS)}")


def order_generator(loader):
    """The generator that draws `loader`'s data order: the one a checkpoint saves and restores."""
    return loader.batch_sampler.generator if isinstance(loader, DataLoader) else loader.generator
