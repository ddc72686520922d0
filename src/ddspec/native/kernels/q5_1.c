/* Q5_1 weights (5-bit levels, an fp16 scale and minimum per 32 inputs), in 8-bit levels: with fp32
 * activations (dd_mm_q5_1) and 8-bit ones (dd_mm_q5_1a8); the passes are kquant.h's. */
#include "kquant.h"

KGEMM(DD_Q5_1, q5_1)
KAGEMM(DD_Q5_1_A8, q5_1a8)
