"""The datasets, held whole in memory as normalised float tensors, and the batch loaders over them."""
from data.datasets import DATASET_NAMES, DataError, ImageData, load_data
from data.loaders import LOADER_KINDS, InMemoryLoader, make_loader, order_generator
