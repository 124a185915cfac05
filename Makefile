# kvq — GNU Make build. `make` builds build/libkvq.a and bin/kv{dump,calib,stat,eval}.
#   make CUDA=0        CPU-only build into build-cpu/, bin-cpu/ (default: CUDA=1 when nvcc is found)
#   make CUDA_ARCH=sm_80  override the GPU architecture (default sm_90)
#   make test          setup + build + run every Check suite
#   make asan          AddressSanitizer + UBSan build of everything, then the tests
#   make bench         benchmarks (tests/bench), results for docs/BENCHMARKS.md
#   make demo          the whole pipeline on the default model and data
#   make V=1           show full compiler command lines
#   make NCCL=0 / MPI=0   build without the multi-GPU pipeline's NCCL / MPI parts (default: on when found; make config)
#   make -jN           parallel build (the CUDA kernel template instances compile as 7 units, build/gen/)
.DEFAULT_GOAL := all
.SECONDARY:

NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
ifeq ($(strip $(NVCC)),)
CUDA ?= 0
else
CUDA ?= 1
endif
CUDA_ARCH ?= sm_90
SAN ?= 0
V ?= 0
Q := $(if $(filter 1,$(V)),,@)

# CPU-only and sanitizer builds get their own folders, so objects of different
# configurations never mix (build-cpu/, bin-cpu/, build-asan/, bin-asan/).
CFG_SUFFIX := $(if $(filter 1,$(SAN)),-asan,$(if $(filter 0,$(CUDA)),-cpu,))
BUILD := build$(CFG_SUFFIX)
BIN := bin$(CFG_SUFFIX)

PKGS := hdf5 libcjson libpcre2-8 cairo fontconfig openblas libcrypto
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS := $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CHECK_CFLAGS := $(shell pkg-config --cflags check 2>/dev/null)
CHECK_LIBS := $(shell pkg-config --libs check 2>/dev/null)

CC ?= cc
OPT ?= -O2
# The library's folders and their subfolders (kernels/model, kernels/cuda, kernels/quant,
# kernels/schemes, kernels/kvcache, analysis/kvdump, analysis/kveval, analysis/kvstat): headers are
# included by bare name, so every folder is on the include path.
LIB_DIRS := $(sort $(shell find formats datasets kernels calib analysis -type d))
INC_FLAGS := -I. $(LIB_DIRS:%=-I%)
CFLAGS := -std=c17 $(OPT) -g -Wall -Wextra -Werror -fopenmp -D_GNU_SOURCE \
          $(INC_FLAGS) $(PKG_CFLAGS) -MMD -MP
LDLIBS := $(PKG_LIBS) -lz -lm -fopenmp -lpthread
ifeq ($(SAN),1)
EMU_SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
CFLAGS += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
LDLIBS += -fsanitize=address,undefined
endif

LIB_SRC := $(foreach d,$(LIB_DIRS),$(wildcard $(d)/*.c))
CU_SRC := $(foreach d,$(LIB_DIRS),$(wildcard $(d)/*.cu))
# kernels/kvcache/kvcache_cuda.cu's kernel template instances, in translation units of their own so that make -jN
# compiles them in parallel (nvcc compiles the kernels of one unit one after another): kv::kivi_fast per (key bits,
# value bits), 44 kernels each, and the NUQ decode kernels per key bits. The units are written here
# ($(BUILD)/gen/kvcache_cuda_inst_<group>.cu); the groups are those of the extern template declarations in
# kvcache_cuda_kivi_fast.cuh and kvcache_cuda_nuq.cuh (a unit missing here fails the link). Each unit costs about a second
# of CPU of its own (headers, host side), so the groups are no smaller than a parallel build needs.
KVC_INST := kivi_2_2 kivi_2_4 kivi_4_2 kivi_4_4 nuq_2 nuq_3 nuq_4
KVC_INST_OBJ := $(KVC_INST:%=$(BUILD)/gen/kvcache_cuda_inst_%.cu.o)
ifeq ($(CUDA),1)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
# NCCL (the multi-GPU pipeline, kernels/cuda/pipeline_nccl.h): NCCL=1 when nccl.h is found, in NCCL_HOME (default: the
# PyPI wheel nvidia-nccl-cu13 that scripts/setup.sh installs, else the CUDA toolkit's). libnccl.so.2 is loaded at run
# time (dlopen: the build's first, then the loader's path), so the binaries start where it is absent. NCCL=0: without.
NCCL_HOME ?= $(shell python3 -c 'import os, nvidia.nccl as n; p = list(n.__path__)[0]; print(p if os.path.exists(p + "/include/nccl.h") else "")' 2>/dev/null)
ifeq ($(strip $(NCCL_HOME)),)
override NCCL_HOME := $(if $(wildcard $(CUDA_HOME)/include/nccl.h),$(CUDA_HOME))
endif
NCCL ?= $(if $(strip $(NCCL_HOME)),1,0)
ifeq ($(NCCL),1)
NCCL_LIB := $(firstword $(wildcard $(NCCL_HOME)/lib/libnccl.so.2 $(NCCL_HOME)/lib64/libnccl.so.2) libnccl.so.2)
NCCL_CFLAGS := -DKVQ_NCCL=1 -I$(NCCL_HOME)/include -DKVQ_NCCL_LIB='"$(NCCL_LIB)"'
endif
CFLAGS += -DKVQ_CUDA=1 $(NCCL_CFLAGS) -I$(CUDA_HOME)/include
NVCCFLAGS ?= -O2 -arch=$(CUDA_ARCH) -std=c++17 -Xcompiler -Wall,-Wextra,-Werror,-fopenmp $(INC_FLAGS)
NVCCFLAGS += $(filter-out -pthread,$(NCCL_CFLAGS))
LDLIBS += -L$(CUDA_HOME)/lib64 -lcublas -lcublasLt -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++
# the longest compilations first, so that a parallel build does not end on one of them
LIB_OBJ := $(KVC_INST_OBJ) $(CU_SRC:%.cu=$(BUILD)/%.cu.o) $(LIB_SRC:%.c=$(BUILD)/%.o)
else
LIB_OBJ := $(LIB_SRC:%.c=$(BUILD)/%.o)
endif

# MPI (the pipeline's processes, one per GPU; kernels/cuda/pipeline_mpi.c): MPI=1 when mpicc (Debian's libopenmpi-dev,
# scripts/setup.sh) is found, in CPU builds too (its host transport runs the CPU stage loop in several processes,
# tests/test_pipeline.c). Only the programs that call MPI keep libmpi (--as-needed).
MPICC ?= $(shell command -v mpicc 2>/dev/null)
MPI ?= $(if $(strip $(MPICC)),1,0)
ifeq ($(MPI),1)
ifeq ($(SAN),0)
CFLAGS += -DKVQ_MPI=1 $(shell $(MPICC) --showme:compile 2>/dev/null)
LDLIBS += -Wl,--as-needed $(shell $(MPICC) --showme:link 2>/dev/null) -Wl,--no-as-needed
endif
endif

LIB := $(BUILD)/libkvq.a
TOOLS := kvdump kvcalib kvstat kveval
TOOL_BINS := $(TOOLS:%=$(BIN)/%)
TEST_SRC := $(wildcard tests/test_*.c)
TEST_BINS := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
# the CUDA decode kernels (v4, v5) run on the host through tests/gpu/emu/cuda_emu.h (C++20, std::thread per CUDA thread)
EMU_BIN := $(BUILD)/tests/test_kvcache_emu
TEST_BINS += $(EMU_BIN)
# the device importance schedule's kernels (kernels/cuda/cuda_sched_kern.cuh) on the host, with gpu_check --sched's harness
SCHED_EMU_BIN := $(BUILD)/tests/test_sched_emu
TEST_BINS += $(SCHED_EMU_BIN)
BENCH_SRC := $(wildcard tests/bench/bench_*.c)
BENCH_BINS := $(BENCH_SRC:tests/bench/%.c=$(BUILD)/bench/%)

# GPU checks and benchmarks (tests/gpu, CUDA=1 only; run by scripts/gpu_kvcache_bench.sh and
# scripts/gpu_check_bench.sh, never by CI).
# --as-needed keeps the binaries free of libraries they do not use (the device image lacks most).
# gpu_check is one binary from gpu_check.c and its parts tests/gpu/gpu_check_*.c (their own rule below).
GPU_CHECK_PARTS := $(wildcard tests/gpu/gpu_check_*.c)
GPU_SRC := $(filter-out $(GPU_CHECK_PARTS),$(wildcard tests/gpu/*.c))
GPU_BINS := $(GPU_SRC:tests/gpu/%.c=$(BUILD)/gpu/%)

.PHONY: all lib tools tests test check-deps check-symbols asan bench demo setup clean help gpu-tests config
all: check-deps $(LIB) $(TOOL_BINS)
lib: $(LIB)
tools: $(TOOL_BINS)
tests: $(TEST_BINS)

help:
	@sed -n "/^#/p;/^[^#]/q" Makefile | sed "s/^# \{0,1\}//"

# what this build has beyond the CPU (also printed by make config)
config:
	@echo "CUDA=$(CUDA) NCCL=$(if $(filter 1,$(CUDA)),$(NCCL),0 (needs CUDA)) $(if $(filter 1,$(CUDA)),$(if $(filter 1,$(NCCL)),NCCL_HOME=$(NCCL_HOME) ))MPI=$(if $(filter 0,$(SAN)),$(MPI),0 (not with SAN=1))"

check-deps:
	@pkg-config --exists $(PKGS) check || { echo "kvq: missing build dependencies (pkg-config: $(PKGS) check)."; \
	  echo "     run 'bash scripts/setup.sh' (as root) or 'make test', which runs it."; exit 1; }

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  CC    $<',true)
	$(Q)$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  NVCC  $<',true)
	$(Q)$(NVCC) $(NVCCFLAGS) -MMD -MP -MF $@.d -c $< -o $@

# every header a CUDA unit includes (.h and .cuh) is a prerequisite through nvcc's dependency file
# ($@.d, read by the -include at the end); without it a .cu object kept the layout of a C struct
# (kvq_family, kvq_kv_desc) from before a header change and the GPU binaries crashed at run time

# an instance unit (KVC_INST), rewritten only when its text changes (editing the Makefile recompiles nothing)
comma := ,
define kvc_inst_unit
	@mkdir -p $(dir $@)
	$(Q)printf '%s\n' '// generated by the Makefile (KVC_INST): one group of kvcache_cuda.cu'"'"'s kernel template instances' \
	  '#define KVQ_KVCACHE_CUDA_INST 1' '#include <cuda_fp16.h>' '#include "kvcache_cuda.h"' \
	  '#include "kvcache_cuda_dec.cuh"' '#include "kvcache_cuda_kivi.cuh"' '#include "kvcache_cuda_nuq.cuh"' \
	  'template $(1);' >$@.tmp
	$(Q)if cmp -s $@.tmp $@; then rm -f $@.tmp; else mv -f $@.tmp $@; fi
endef
$(BUILD)/gen/kvcache_cuda_inst_kivi_%.cu: Makefile
	$(call kvc_inst_unit,kv::FastFn kv::fast_pick_nw<$(subst _,$(comma) ,$*)>(int$(comma) int$(comma) int))
$(BUILD)/gen/kvcache_cuda_inst_nuq_%.cu: Makefile
	$(call kvc_inst_unit,DecFn nuq_kernel<$*>(int$(comma) int$(comma) int))

$(BUILD)/gen/%.cu.o: $(BUILD)/gen/%.cu
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  NVCC  $<',true)
	$(Q)$(NVCC) $(NVCCFLAGS) -MMD -MP -MF $@.d -c $< -o $@

$(LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  AR    $@',true)
	$(Q)rm -f $@ && ar rcs $@ $^

$(BIN)/%: $(BUILD)/cmd/%.o $(LIB)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  LD    $@',true)
	$(Q)$(CC) $(CFLAGS) $< $(LIB) $(LDLIBS) -o $@

$(BUILD)/tests/%: tests/%.c tests/kvq_test.h $(LIB)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  LD    $@',true)
	$(Q)$(CC) $(CFLAGS) $(CHECK_CFLAGS) $< $(LIB) $(CHECK_LIBS) $(LDLIBS) -o $@

$(EMU_BIN): tests/gpu/emu/emu_kvcache_dec.cc tests/gpu/emu/cuda_emu.h tests/kvcache_synth.h kernels/kvcache/kvcache_cuda_dec.cuh kernels/kvcache/kvcache_cuda_app.cuh $(wildcard kernels/kvcache/kvcache_cuda_kivi*.cuh) $(LIB)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  CXX   $@',true)
	$(Q)$(CXX) -std=c++20 $(OPT) -g -Wall -Wextra -Werror -Wno-unknown-pragmas \
	  $(EMU_SANFLAGS) \
	  $(INC_FLAGS) -Itests/gpu/emu $< $(LIB) $(LDLIBS) -o $@

$(SCHED_EMU_BIN): tests/gpu/emu/emu_sched.cc tests/gpu/gpu_check_sched.c tests/gpu/gpu_check_sched.h tests/gpu/gpu_check.h \
                  tests/gpu/emu/cuda_emu.h kernels/cuda/cuda_sched_kern.cuh kernels/cuda/cuda_sched.cuh $(LIB)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  CXX   $@',true)
	$(Q)$(CC) $(CFLAGS) -c tests/gpu/gpu_check_sched.c -o $@.harness.o
	$(Q)$(CXX) -std=c++20 $(OPT) -g -Wall -Wextra -Werror -Wno-unknown-pragmas \
	  $(EMU_SANFLAGS) \
	  $(INC_FLAGS) -Itests/gpu -Itests/gpu/emu $< $@.harness.o $(LIB) $(LDLIBS) -o $@

$(BUILD)/bench/%: tests/bench/%.c $(LIB)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  LD    $@',true)
	$(Q)$(CC) $(CFLAGS) $< $(LIB) $(LDLIBS) -o $@

gpu-tests: $(if $(filter 1,$(CUDA)),$(GPU_BINS),gpu-tests-need-cuda)
gpu-tests-need-cuda:
	@echo "kvq: gpu-tests needs CUDA=1 (nvcc)"; exit 1

$(BUILD)/gpu/%: tests/gpu/%.c $(LIB)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  LD    $@',true)
	$(Q)$(CC) $(CFLAGS) $< -Wl,--as-needed $(LIB) $(LDLIBS) -o $@

# bench_decode_step has device kernels of its own (tests/gpu/bench_decode_step_kern.cu, through $(BUILD)/%.cu.o)
$(BUILD)/gpu/bench_decode_step: tests/gpu/bench_decode_step.c tests/gpu/bench_decode_step_kern.h tests/gpu/decode_plan.h \
                                $(BUILD)/tests/gpu/bench_decode_step_kern.cu.o $(LIB)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  LD    $@',true)
	$(Q)$(CC) $(CFLAGS) $< $(BUILD)/tests/gpu/bench_decode_step_kern.cu.o -Wl,--as-needed $(LIB) $(LDLIBS) -o $@

$(BUILD)/gpu/gpu_check: tests/gpu/gpu_check.c $(GPU_CHECK_PARTS) tests/gpu/gpu_check.h $(LIB)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo '  LD    $@',true)
	$(Q)$(CC) $(CFLAGS) tests/gpu/gpu_check.c $(GPU_CHECK_PARTS) -Wl,--as-needed $(LIB) $(LDLIBS) -o $@

setup:
	bash scripts/setup.sh

# Tests run from the repo root; ../shared and models/ are optional (tests skip with a message).
test: setup
	$(MAKE) all tests
	@$(MAKE) --no-print-directory check-symbols
	@KVQ_BIN_DIR=$(BIN) bash scripts/run_tests.sh $(TEST_BINS)

# Every symbol the library exports carries the kvq prefix (kvq_ public, kvqi_ shared between the files
# of one component): a short name such as file_exists or put_attr would clash with a user's program. C++
# names (the CUDA units') are checked demangled; those of anonymous namespaces (unique per unit) pass.
check-symbols: $(LIB)
	@syms=$$(nm -g --defined-only $(LIB) | awk '$$2 ~ /^[TDBRV]$$/ {print $$3}'); \
	bad=$$(printf '%s\n' "$$syms" | grep -v '^kvq\|^_\|^DW\.ref\.' | sort -u); \
	bad="$$bad$$(printf '%s\n' "$$syms" | grep '^_Z' | grep -v '_GLOBAL__N_' | c++filt | grep -v '^kvq' | sort -u)"; \
	if [ -n "$$bad" ]; then echo "check-symbols: $(LIB) exports names without the kvq prefix:"; echo "$$bad"; exit 1; fi; \
	echo "check-symbols: every exported symbol of $(LIB) has the kvq prefix"

asan:
	bash scripts/setup.sh --no-model
	$(MAKE) SAN=1 CUDA=0 OPT=-O1 all tests
	@ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  KVQ_TEST_QUICK=1 KVQ_BIN_DIR=bin-asan bash scripts/run_tests.sh $(patsubst $(BUILD)/%,build-asan/%,$(TEST_BINS))

bench: all $(BENCH_BINS)
	@for b in $(BENCH_BINS); do echo "== $$b"; $$b || exit 1; done

demo: setup all
	KVQ_BIN_DIR=$(BIN) bash scripts/demo.sh

clean:
	rm -rf build build-asan build-cpu bin bin-asan bin-cpu

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
