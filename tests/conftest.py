import os

# Tests run on the CPU only, whatever the machine has.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
