/* fp32 weights: dd_mm_f32 (the passes of dense.h). */
#include "dense.h"

PASSES(DD_F32, f32)
DGEMM(f32)
