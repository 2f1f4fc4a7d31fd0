"""kernels.py's CUDA kernels, run on the CPU under CUDA's execution model. The device source
(kernels.GEMV_CU) is compiled unchanged with the host compiler, after a small header that gives
the CUDA built-ins their meaning: a std::thread per CUDA thread, blocks run one at a time (so a
`__shared__` array is a static one), `__syncthreads` a barrier of the block, and the shuffles
real exchanges among the 32 lanes of a warp. The result must equal linear_reference bit for bit.
This checks the arithmetic and the indexing; not speed, coalescing or real warp scheduling."""
import faulthandler
import multiprocessing
import os

import numpy as np
import pytest
import torch

import kernels

HEADER = r"""
#include <torch/extension.h>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct int4 { int x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
using std::min;
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

struct Barrier {  // all n threads wait until the last one arrives
  std::mutex m; std::condition_variable cv; int n, count = 0, gen = 0;
  explicit Barrier(int n) : n(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    int g = gen;
    if (++count == n) { count = 0; gen++; cv.notify_all(); } else cv.wait(lock, [&] { return g != gen; });
  }
};
Barrier* block_barrier;
std::vector<std::unique_ptr<Barrier>> warp_barriers;
std::vector<unsigned> lanes;  // one 4-byte slot per thread of the block, for shuffles

template <class T> T exchange(T v, int src) {  // every lane of the warp posts v, then reads lane src's
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  std::memcpy(&lanes[threadIdx.x], &v, 4);
  warp_barriers[warp]->wait();
  T r; std::memcpy(&r, &lanes[warp * 32 + (src < 32 ? src : lane)], 4);
  warp_barriers[warp]->wait();
  return r;
}
template <class T> T __shfl_xor_sync(unsigned, T v, int o) { return exchange(v, (threadIdx.x % 32) ^ o); }
template <class T> T __shfl_down_sync(unsigned, T v, int d) { return exchange(v, threadIdx.x % 32 + d); }
void __syncthreads() { block_barrier->wait(); }
template <class T> T __ldg(const T* p) { return *p; }
int __dp4a(int a, int b, int c) {  // four signed byte products, summed into c
  for (int i = 0; i < 4; i++) c += (int8_t)(a >> 8 * i) * (int8_t)(b >> 8 * i);
  return c;
}
unsigned __vsub4(unsigned a, unsigned b) {  // bytewise a - b, modulo 256
  unsigned r = 0;
  for (int i = 0; i < 4; i++) r |= ((((a >> 8 * i) & 0xff) - ((b >> 8 * i) & 0xff)) & 0xff) << 8 * i;
  return r;
}
#define __global__
#define __shared__ static

template <class F> void launch(dim3 grid, dim3 block, F kernel, int64_t only = -1) {
  // the grid's blocks one after another (`only`: just that block), each with its threads at once
  gridDim = grid; blockDim = block;
  for (unsigned by = 0; by < grid.y; by++)
    for (unsigned bx = 0; bx < grid.x; bx++) {
      if (only >= 0 && bx + (int64_t)by * grid.x != only) continue;
      Barrier bar(block.x);
      block_barrier = &bar;
      warp_barriers.clear();
      for (unsigned w = 0; w < block.x / 32; w++) warp_barriers.emplace_back(new Barrier(32));
      lanes.assign(block.x, 0);
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < block.x; t++)
        threads.emplace_back([&, t] { threadIdx = dim3{t, 0, 0}; blockIdx = dim3{bx, by, 0}; kernel(); });
      for (auto& th : threads) th.join();
    }
}
"""

# what kernels.LAUNCH_CU does, with launch() in place of <<<grid, block>>>; variant 0: kernels.py's
# kernels, 1: MUTANT, 2: OLD
LAUNCHER = r"""
#define PICK(f) (variant == 1 ? mutant::f : variant == 2 ? old::f : f)

std::vector<torch::Tensor> quantize(torch::Tensor x, int64_t Kp, int64_t variant) {
  const int M = x.size(0), K = x.size(1);
  auto xq = torch::empty({M, Kp}, torch::kChar);
  auto s = torch::empty({M}, torch::kFloat);
  launch(dim3{(unsigned)M}, dim3{256}, [&] { PICK(quantize_rows)(x.data_ptr<float>(), xq.data_ptr<int8_t>(), s.data_ptr<float>(), K, Kp); });
  return {xq, s};
}

void gemv(torch::Tensor x, torch::Tensor w, torch::Tensor gamma, torch::Tensor y, int64_t only, int64_t variant) {
  const int M = x.size(0), N = w.size(0), Kp = 4 * w.size(1);
  auto q = quantize(x, Kp, variant);
  auto kernel = PICK(gemv_for)(M);
  launch(dim3{(unsigned)(N + WARPS * ROWS - 1) / (WARPS * ROWS)}, dim3{32 * WARPS}, [&] {
    kernel(q[0].data_ptr<int8_t>(), w.data_ptr<uint8_t>(), q[1].data_ptr<float>(), gamma.data_ptr<float>(),
           y.data_ptr<float>(), M, N, Kp, gamma.numel() > 1); }, only);
}

void scale(torch::Tensor acc, torch::Tensor s, torch::Tensor gamma, torch::Tensor y, int64_t variant) {
  const int M = y.size(0), N = y.size(1);
  launch(dim3{(unsigned)(M * N + 255) / 256}, dim3{256}, [&] {
    PICK(rescale)(acc.data_ptr<int>(), acc.size(1), s.data_ptr<float>(), gamma.data_ptr<float>(), y.data_ptr<float>(),
                  M, N, gamma.numel() > 1); });
}
"""

DEVICE = kernels.GEMV_CU.replace('#include <cstdint>', '')
# two indices broken on purpose, each off by one: the GEMV's activations (the word of a 256-column block
# they land in), the rescale's column of acc
MUTANT = DEVICE.replace('j = u / 16 * 4 + u % 4;', 'j = u / 16 * 4 + (u + 1) % 4;').replace(
    'acc[(size_t)m * lda + n]', 'acc[(size_t)m * lda + (n + 1) % N]')
# the GEMV as it was, its index into y computed in int
OLD = DEVICE.replace('y[(size_t)m * N + n0 + r]', 'y[m * N + n0 + r]')


@pytest.fixture(scope='module')
def emulator():
    from torch.utils.cpp_extension import load_inline
    assert MUTANT.count('(u + 1) % 4') == 1 and MUTANT.count('(n + 1) % N') == 1 and OLD.count('y[m * N') == 1
    source = HEADER + kernels.GEMV_CU + ''.join(f'namespace {name} {{\n{src}\n}}\n' for name, src in
                                                (('mutant', MUTANT), ('old', OLD))) + LAUNCHER
    return load_inline('nanobitnet_cuda_on_cpu', source, functions=['quantize', 'gemv', 'scale'],
                       extra_cflags=['-O1'])


def emulated(emulator, x, w, gamma, variant=0):
    """kernels.linear_cuda's two paths: the GEMV up to 16 tokens, above that quantize_rows, the int8
    product of the unpacked copy (torch._int_mm's integers, here on the CPU) and rescale."""
    M, N = x.shape[0], w.shape[0]
    y = torch.full((M, N), float('nan'))
    if M <= 16:
        emulator.gemv(x.contiguous(), w, gamma, y, -1, variant)
        return y
    x_q, s = emulator.quantize(x.contiguous(), 4 * w.shape[1], variant)
    acc = (x_q.long() @ kernels.unpacked(w).long().T).int()
    emulator.scale(acc, s, gamma, y, variant)
    return y


def inputs(M, K, N):
    g = torch.Generator().manual_seed(M * 10_000 + K + N)
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4
    x[0, 0] = 100.0  # one token's absmax far above the rest
    if M > 2:
        x[1] = 0.0  # an all-zero token
    w = kernels.pack(torch.randint(-1, 2, (N, K), generator=g))
    # one gamma, or one per row (q/k/v or gate/up fused into one matrix; weight_scale='row')
    gamma = torch.tensor([0.0371]) if M % 2 else torch.rand(N, generator=g) + 0.01
    return x, w, gamma


# every GEMV (1, 2, 4, 8, 16 tokens), one and several blocks of 32 rows, ragged ones, K in several
# shared-memory tiles (16 tokens: 2048 columns a tile; one token: 32768); above 16 tokens the int8 path
CASES = ([(M, K, N) for M in (1, 2, 3, 4, 5, 16) for K, N in ((64, 32), (256, 7), (4100, 45))]
         + [(1, 33000, 40), (16, 33000, 9)] + [(M, K, N) for M in (17, 40) for K, N in ((256, 7), (4100, 64))])


@pytest.mark.slow
@pytest.mark.parametrize('M,K,N', CASES)
def test_cuda_kernels_on_the_cpu_equal_the_reference(emulator, M, K, N):
    x, w, gamma = inputs(M, K, N)
    want = kernels.linear_reference(x, w, gamma)
    assert torch.equal(emulated(emulator, x, w, gamma), want)
    # the harness can fail: a copy with one index broken gives other numbers
    assert not torch.equal(emulated(emulator, x, w, gamma, variant=1), want)


def last_block(emulator, x, w, gamma, y, variant, want):
    """In a forked child: the grid's last block alone; exit 0 if it wrote `want` where it belongs."""
    faulthandler.disable()  # a crash is one of the expected outcomes: no traceback dump for it
    emulator.gemv(x, w, gamma, y, (w.shape[0] + 31) // 32 - 1, variant)  # rows N-4 .. N-1
    os._exit(0 if torch.equal(y[:, -4:], want) else 3)


@pytest.mark.slow
def test_output_index_past_2_to_the_31(emulator, tmp_path):
    """A long prefill with a large vocabulary: M * N > 2^31 outputs. The index of y must not wrap
    around, as it did while it was an int (a crash or a write to the wrong place). Only the grid's
    last block runs, against sparse files: y has 2^31 + 16 floats (8 GiB) and w 2^29 + 4 rows, but
    only their last pages are touched."""
    M, K, N = 4, 64, 2 ** 29 + 4
    assert M * N > 2 ** 31 - 1
    w = torch.from_numpy(np.memmap(tmp_path / 'w', np.uint8, 'w+', shape=(N, 64)))
    y = torch.from_numpy(np.memmap(tmp_path / 'y', np.float32, 'w+', shape=(M, N)))
    w_q = torch.randint(-1, 2, (4, K), generator=torch.Generator().manual_seed(0))
    w[-4:] = kernels.pack(w_q)
    x, gamma = torch.randn(M, K, generator=torch.Generator().manual_seed(1)), torch.tensor([0.5])
    want = kernels.linear_reference(x, kernels.pack(w_q), gamma)
    exits = []
    for variant in (0, 2):  # kernels.py's, then the int-indexed one
        child = multiprocessing.get_context('fork').Process(target=last_block, args=(emulator, x, w, gamma, y,
                                                                                       variant, want))
        child.start()
        child.join()
        exits.append(child.exitcode)
    assert exits[0] == 0 and exits[1] != 0, exits
