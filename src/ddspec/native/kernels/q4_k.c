/* Q4_K weights (4-bit levels, a scale and a minimum per 32 inputs under fp16 super-block scales):
 * with fp32 activations (dd_mm_q4_k) and 8-bit ones (dd_mm_q4_ka8); the passes are kquant.h's. */
#include "kquant.h"

KGEMM(DD_Q4_K, q4_k)
KAGEMM(DD_Q4_K_A8, q4_ka8)
