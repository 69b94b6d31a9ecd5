# laguna -- build and test
#   make             the CPU build (./laguna)
#   make cuda        the GPU build (./laguna with the CUDA backend; CUDA_ARCH=90 for H100/H200)
#   make test        the test suite (CPU; what CI runs)
#   make test-gpu    the GPU tests (on a machine with an NVIDIA GPU)
CC ?= cc
CFLAGS ?= -O3 -std=c11 -Wall -Wextra -fopenmp
LDLIBS = -lm
NVCC ?= nvcc
CUDA_ARCH ?= 90
NVCCFLAGS ?= -O3 -std=c++17 -arch=sm_$(CUDA_ARCH) -Xcompiler -fopenmp,-Wall,-Wextra

SRC = laguna.c tokenizer.c
HDR = laguna.h tokenizer.h tokenizer_unicode.h

laguna: $(SRC) $(HDR)
	$(CC) $(CFLAGS) $(SRC) -o $@ $(LDLIBS)

# the debug build the valgrind test uses: no OpenMP threads (its pragmas are left out on purpose), symbols
laguna-debug: $(SRC) $(HDR)
	$(CC) -O1 -g -std=c11 -Wall -Wextra -Wno-unknown-pragmas $(SRC) -o $@ $(LDLIBS)

# the sanitizer build (AddressSanitizer + UndefinedBehaviorSanitizer, no OpenMP threads): test_sanitizers_clean runs
# it in `make test`, dev/cli_fuzz.py random command lines against it (dev/gpu_notes.md, round 42)
laguna-asan: $(SRC) $(HDR)
	$(CC) -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -std=c11 \
		-Wall -Wextra -Wno-unknown-pragmas $(SRC) -o $@ $(LDLIBS)

test: laguna
	python3 -m pytest -q test/

# the GPU backend, compiled once for the GPU build and the benchmarks
laguna-cu.o: laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) -c laguna.cu -o $@

# the GPU build: laguna.c with -DLAGUNA_CUDA + tokenizer.c (host compiler) and laguna.cu (nvcc), linked by nvcc
cuda: laguna-cu.o $(SRC) $(HDR)
	$(CC) $(CFLAGS) -DLAGUNA_CUDA -c laguna.c -o laguna-gpu.o
	$(CC) $(CFLAGS) -c tokenizer.c -o tokenizer.o
	$(NVCC) $(NVCCFLAGS) laguna-gpu.o tokenizer.o laguna-cu.o -o laguna -lcublas -lm

# compile the GPU backend without a GPU (what CI checks: it has nvcc but no GPU)
cuda-compile: laguna.cu $(SRC) $(HDR)
	$(NVCC) $(NVCCFLAGS) -c laguna.cu -o laguna-cu.o
	$(CC) $(CFLAGS) -DLAGUNA_CUDA -c laguna.c -o laguna-gpu.o

# GPU tests and benchmark (on a machine with an NVIDIA GPU; test-gpu skips cleanly without one)
test-gpu:
	python3 -m pytest -q -s -rs test/test_gpu.py test/test_gpu_fidelity.py

# the same tests in four parts, meant to fit one device call each (the whole does not on an H100; each prints its
# slowest tests): 1 the kernel labs (tests named *lab*), 2 the rest of the single-model tests, 3 DFlash and the
# mid-size model, 4 quantization and fidelity. Their pytest times on an H100 (2026-12-07): 391, 358, 276 and 177 s;
# a fresh `make -j16 cuda` there adds ~140 s
GPU_LABS = lab
GPU_PART3 = dflash or mid_size
GPU_PART4 = quant or fidelity
GPU_PYTEST = python3 -m pytest -q -s -rs --durations=15
test-gpu-1:
	$(GPU_PYTEST) test/test_gpu.py -k "$(GPU_LABS) and not ($(GPU_PART3)) and not ($(GPU_PART4))"
test-gpu-2:
	$(GPU_PYTEST) test/test_gpu.py -k "not ($(GPU_LABS)) and not ($(GPU_PART3)) and not ($(GPU_PART4))"
test-gpu-3:
	$(GPU_PYTEST) test/test_gpu.py -k "$(GPU_PART3)"
test-gpu-4:
	$(GPU_PYTEST) test/test_gpu.py test/test_gpu_fidelity.py -k "($(GPU_PART4)) and not ($(GPU_PART3))"

# the GPU build under compute-sanitizer (memcheck by default; TOOLS="memcheck racecheck synccheck initcheck"): the
# tiny model and a 5-layer synthetic XS-2.1 through every decode, prefill, few-token, DFlash, sampler and
# long-context path; LINEINFO=1 rebuilds laguna.cu with -lineinfo so reports name file:line (dev/device_sanitize.sh)
sanitize-gpu:
	bash dev/device_sanitize.sh

dev/bench_gpu: dev/bench_gpu.c laguna-cu.o $(SRC) $(HDR)
	$(CC) $(CFLAGS) -Wno-unused-function -DLAGUNA_CUDA -c dev/bench_gpu.c -o bench_gpu.o
	$(CC) $(CFLAGS) -c tokenizer.c -o tokenizer.o
	$(NVCC) $(NVCCFLAGS) bench_gpu.o tokenizer.o laguna-cu.o -o $@ -lcublas -lm

# the decode step's kernels traced block by block (LAGUNA_TRACE_OUT=FILE; dev/trace_summary.py, dev/gpu_notes.md):
# bench_gpu against laguna.cu built with -DLAGUNA_TRACE, in objects of its own (the normal build is untouched)
laguna-cu-trace.o: laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) -DLAGUNA_TRACE -c laguna.cu -o $@

dev/bench_gpu_trace: dev/bench_gpu.c laguna-cu-trace.o $(SRC) $(HDR)
	$(CC) $(CFLAGS) -Wno-unused-function -DLAGUNA_CUDA -DLAGUNA_TRACE -c dev/bench_gpu.c -o bench_gpu_trace.o
	$(CC) $(CFLAGS) -c tokenizer.c -o tokenizer.o
	$(NVCC) $(NVCCFLAGS) bench_gpu_trace.o tokenizer.o laguna-cu-trace.o -o $@ -lcublas -lm

# DFlash at the full shapes: the drafter's cost against a decode step, and the projected speedup
dev/bench_dflash: dev/bench_dflash.c laguna-cu.o $(SRC) $(HDR)
	$(CC) $(CFLAGS) -Wno-unused-function -DLAGUNA_CUDA -c dev/bench_dflash.c -o bench_dflash.o
	$(CC) $(CFLAGS) -c tokenizer.c -o tokenizer.o
	$(NVCC) $(NVCCFLAGS) bench_dflash.o tokenizer.o laguna-cu.o -o $@ -lcublas -lm

dev/matvec_lab: dev/matvec_lab.cu laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) dev/matvec_lab.cu -o $@ -lcublas

# what one kernel of a decode-style chain costs (fixed part and streaming rate; dev/gpu_notes.md)
dev/chain_lab: dev/chain_lab.cu dev/lab_graph.h laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) dev/chain_lab.cu -o $@ -lcublas

# decode matvecs that stream weights through shared memory with bulk copies, against laguna.cu's (dev/gpu_notes.md)
dev/bulk_lab: dev/bulk_lab.cu dev/lab_graph.h laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) dev/bulk_lab.cu -o $@ -lcublas

# an expert's gate/up and down in one thread-block cluster, against laguna.cu's two kernels (dev/gpu_notes.md)
dev/expert_lab: dev/expert_lab.cu dev/lab_graph.h laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) dev/expert_lab.cu -o $@ -lcublas

# the experts' bytes read in several access shapes, and the few-token mma on row-major / interleaved rows
dev/access_lab: dev/access_lab.cu laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) dev/access_lab.cu -o $@ -lcublas

# what a dependent load (DRAM or L2) costs while a stream keeps N bytes in flight (dev/gpu_notes.md)
dev/latency_lab: dev/latency_lab.cu laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) dev/latency_lab.cu -o $@ -lcublas

# the tensor-core kernels for 2..16 tokens (verification) against a CPU reference, cuBLAS and the warp kernels
dev/few_lab: dev/few_lab.cu dev/lab_graph.h laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) dev/few_lab.cu -o $@ -lcublas
dev/skinny_lab: dev/skinny_lab.cu dev/lab_graph.h laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) dev/skinny_lab.cu -o $@ -lcublas

# the device sampler's kernels against the CPU's top-p rule and distribution, V 16 .. 100,352 (dev/gpu_notes.md)
dev/sample_lab: dev/sample_lab.cu laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) dev/sample_lab.cu -o $@ -lcublas

bench: dev/bench_gpu dev/matvec_lab dev/bench_dflash
	./dev/matvec_lab
	python3 export.py -q --synthetic XS-2.1 /dev/shm/xs21.bin
	./dev/bench_gpu /dev/shm/xs21.bin
	python3 export.py -q --synthetic XS-2.1-DFlash /dev/shm/xs21-dflash.bin
	./dev/bench_dflash /dev/shm/xs21.bin /dev/shm/xs21-dflash.bin

.PHONY: clean test cuda cuda-compile test-gpu test-gpu-1 test-gpu-2 test-gpu-3 test-gpu-4 sanitize-gpu bench
clean:
	rm -f laguna laguna-debug laguna-asan laguna-cuda dev/bench_gpu dev/bench_gpu_trace dev/bench_dflash dev/matvec_lab dev/moe_gemm_lab dev/chain_lab dev/bulk_lab dev/few_lab dev/skinny_lab dev/sample_lab dev/expert_lab dev/latency_lab dev/access_lab bench_tokenizer *.o

# tokenizer speed: encode a file, tokens/s on one core (./bench_tokenizer BLOB FILE; dev/bench_tokenizer.c: the blob)
bench_tokenizer: dev/bench_tokenizer.c tokenizer.c tokenizer.h tokenizer_unicode.h
	$(CC) -O2 -std=c11 -Wall -Wextra -I. dev/bench_tokenizer.c tokenizer.c -o $@

dev/moe_gemm_lab: dev/moe_gemm_lab.cu laguna.cu laguna.h
	$(NVCC) $(NVCCFLAGS) dev/moe_gemm_lab.cu -o $@ -lcublas
