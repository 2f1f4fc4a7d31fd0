# A config file that prints each rank's peak resident memory when the run ends, for the README's
# DDP / ZeRO-1 / FSDP2 table:  torchrun --nproc_per_node=2 train.py tests/peak_rss.py ...
import atexit
import os
import resource

atexit.register(lambda: print(f"rank {os.environ.get('RANK', 0)}: peak RSS "
                              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB", flush=True))
