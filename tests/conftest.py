import os
import sys

# Spawned ranks import rank functions from this folder by module name.
sys.path.insert(0, os.path.dirname(__file__))
