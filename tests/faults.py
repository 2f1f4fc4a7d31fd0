# A config file that injects faults into a real `python train.py` run (tests/test_loop.py passes it
# first on the command line). The environment says what to break:
#   FAULT_NAN=3,4    these calls of the CE loss (counted from 1) return NaN
#   FAULT_SPIKE=30   these return the loss x1000 (a gradient spike)
#   FAULT_SAVE_DELAY=0.5  seconds of sleep before every torch.save (to kill a run mid-checkpoint)
#   FAULT_ENOSPC=2   this torch.save (counted from 1) writes half its bytes, then fails as a full disk does
import errno
import io
import os
import time

import torch

import objectives

_calls, _saves, _ce, _save = [0], [0], objectives.CrossEntropy.loss, torch.save
_nan, _spike = ({int(c) for c in os.environ.get(k, '').split(',') if c} for k in ('FAULT_NAN', 'FAULT_SPIKE'))


def _loss(self, batch, s, t):
    _calls[0] += 1
    out = _ce(self, batch, s, t)
    return out * float('nan') if _calls[0] in _nan else out * 1000 if _calls[0] in _spike else out


def _slow_save(obj, path, *args, **kwargs):
    time.sleep(float(os.environ.get('FAULT_SAVE_DELAY', 0)))
    _saves[0] += isinstance(path, str)  # checkpoint files, not the buffers torch.distributed pickles into
    if isinstance(path, str) and str(_saves[0]) == os.environ.get('FAULT_ENOSPC'):
        buf = io.BytesIO()
        _save(obj, buf, *args, **kwargs)
        with open(path, 'wb') as f:
            f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return _save(obj, path, *args, **kwargs)


objectives.CrossEntropy.loss = _loss
torch.save = _slow_save
