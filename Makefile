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

# the debug build the valgrind test uses: no OpenMP threads, symbols
laguna-debug: $(SRC) $(HDR)
	$(CC) -O1 -g -std=c11 -Wall -Wextra $(SRC) -o $@ $(LDLIBS)

test: laguna
	python3 -m pytest -q test/

.PHONY: clean test
clean:
	rm -f laguna laguna-debug laguna-cuda *.o

# tokenizer speed: encode a file, tokens/s on one core (make bench_tokenizer && ./bench_tokenizer MODEL.bin FILE)
bench_tokenizer: dev/bench_tokenizer.c tokenizer.c tokenizer.h tokenizer_unicode.h
	$(CC) -O2 -std=c11 -Wall -Wextra -I. dev/bench_tokenizer.c tokenizer.c -o $@
