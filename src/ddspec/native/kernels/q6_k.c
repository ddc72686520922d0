/* Q6_K weights, and every K type in 8-bit levels (Q5_K, Q3_K, and Q4_K stacked with them): a scale
 * per 16 inputs and a minimum per 32 under each super-block's d and dmin, with fp32 activations
 * (dd_mm_q6_k) and 8-bit ones (dd_mm_q6_ka8); the passes are kquant.h's. */
#include "kquant.h"

KGEMM(DD_Q6_K, q6_k)
KAGEMM(DD_Q6_K_A8, q6_ka8)
