"""linear-lab's hand-written linear operator."""
from ext._build import load_library

load_library()
