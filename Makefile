# The Inference Path: two commands do everything, on a fresh machine with Python 3.10+.
#   make book   build the book (HTML in _build/html/intro.html)
#   make test   lint, unit tests, reference checks, notebooks, strict book build, page screenshots
#   make lab    open the chapters in JupyterLab, on the project's kernel, to run them cell by cell
# Both are idempotent: the virtual environment is made once and reinstalled only when
# pyproject.toml changes; the model is fetched once and checked by its SHA-256.

PYTHON ?= python3

# `make test CPU=avx2` (or CPU=zen4) runs everything as that class of CPU would run it, on this
# one: llmlib takes that class's choices (LLMLIB_AS_CPU) and PyTorch, inductor, oneDNN and MKL are
# held to its instructions. Its code paths, not its speed (llmlib/kernels/flags.py says more).
CPU ?=
ifeq ($(CPU),avx2)
export LLMLIB_AS_CPU=avx2
export ATEN_CPU_CAPABILITY=avx2
export ONEDNN_MAX_CPU_ISA=AVX2
export MKL_ENABLE_INSTRUCTIONS=AVX2
else ifeq ($(CPU),zen4)
export LLMLIB_AS_CPU=zen4
export ATEN_CPU_CAPABILITY=avx512
export ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
export MKL_ENABLE_INSTRUCTIONS=AVX512
else ifneq ($(CPU),)
$(error CPU=$(CPU): expected avx2 or zen4, or nothing for this machine's own class)
endif
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
JB     := $(BIN)/jupyter-book build -W -n --keep-going .

.PHONY: book test lab venv fetch lint unit test-big build-book pages gpu-wheels gpu-check gpu-check-dry clean

book: venv fetch
	$(JB)
	@echo
	@echo "The book is at $(CURDIR)/_build/html/intro.html"

test: venv fetch lint unit build-book pages

# JupyterLab on the chapters with this environment's Python as the kernel. The kernel spec is
# written into the venv (it wins over a user-wide "python3" inside a venv), so the notebooks run
# on the venv's Python and llmlib whatever else is installed. The book's extras bring
# jupyterlab-myst, which renders the chapters' MyST (admonitions, figures, glossary links, and
# the numbers the prose quotes with {eval}, filled in as the cells run: Run > Run All Cells).
# LAB_ARGS=--no-browser on a server.
LAB_ARGS ?=
lab: venv fetch
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (The Inference Path)" >/dev/null
	$(BIN)/jupyter lab $(LAB_ARGS) chapters/01_the_inference_path.ipynb

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10 or newer is needed"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e ".[test,book]"
	touch $(STAMP)

fetch: venv
	$(BIN)/llmlib fetch

# Lint and format checks (ruff, configured in pyproject.toml): the package, the tests, the benchmarks.
lint: venv
	$(BIN)/ruff check llmlib tests benchmarks
	$(BIN)/ruff format --check llmlib tests benchmarks

# Unit tests and the checks against reference libraries (transformers, tokenizers, tiktoken), in
# WORKERS pytest-xdist processes of one torch thread each (tests/conftest.py): on two cores that
# takes about two thirds of the time one process with two threads does, as many tests leave a
# core idle. tests/test_threads.py runs every kernel on one thread and on two.
WORKERS ?= 2
unit: venv fetch
	$(BIN)/python -m pytest -q -n $(WORKERS) -m "not pages" -p no:cacheprovider --durations=25

# The one test too big for `make test`: a whole 8B-shaped Q4_K_M file (4.9 GB in a temporary
# folder, removed after) loads within 1.3x of its size and decodes. About 2 min and 6 GB here.
test-big: venv
	LLMLIB_TEST_BIG=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_load_memory.py -k 8b

# The strict build executes every notebook: a failing cell or a broken reference fails it.
build-book: venv fetch
	$(JB)

# Screenshots of every chapter page in headless Chromium (installed here if missing), WORKERS
# pages at a time, as the unit tests run; and every executed chapter opened in JupyterLab
# (tests/test_book_lab.py), its screenshots under _build/screenshots/lab.
pages: venv
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { echo "installing Debian's chromium for the page screenshots"; \
	    $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q chromium >/dev/null || \
	    { $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -q >/dev/null && \
	      $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q chromium >/dev/null; }; }
	$(BIN)/python -m pytest -q -n $(WORKERS) -m pages -p no:cacheprovider

# The GPU check: tests and benchmarks on a CUDA machine, results under results/gpu/. It runs with
# the machine's own Python (torch with CUDA already installed there, no network), not the venv.
# The prepared GPU run, on a lent machine's image as it is (Python 3.12, its own torch, triton,
# transformers, httpx): `make gpu-wheels` here downloads the few pure wheels that image lacks
# (the server's fastapi and pydantic, gguf; 3 MB) into .gpu-wheels/, which the run carries;
# there, `make gpu-check OUT=$$OUT` installs them into a folder of their own and writes every
# record under OUT. Its budget: 8 minutes on an H100, compiles and captures included (the
# throughput section stops itself at 120 s); run it with a 9-minute timeout.
OUT ?= results/gpu
GPU_WHEELS = fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.55.0 gguf==0.19.0

gpu-wheels: venv
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .gpu-wheels $(GPU_WHEELS)

gpu-check:
	$(PYTHON) -m pip install --quiet --no-index --no-deps --target /tmp/llmlib-gpu-site .gpu-wheels/*.whl
	PYTHONPATH=/tmp/llmlib-gpu-site:$(CURDIR) $(PYTHON) benchmarks/gpu_check.py --out $(OUT)

gpu-check-dry: venv
	$(BIN)/python benchmarks/gpu_check.py --dry-run --out /tmp/llmlib-gpu-check-dry

clean:
	rm -rf _build
