/* fp16 and bf16 weights holding fp32 values exactly: dd_mm_f16, dd_mm_bf16 (the passes of dense.h). */
#include "dense.h"

PASSES(DD_F16, f16)
DGEMM(f16)
PASSES(DD_BF16, bf16)
DGEMM(bf16)
