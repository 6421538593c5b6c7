// The IQ1/IQ2/IQ3 block encoders behind one call, each with its lattice tables (iq_grid.cuh).
#pragma once
#include "iq1.cuh"
#include "iq2.cuh"
#include "iq3.cuh"

// One block of an IQ1/IQ2/IQ3 type `ty`; false for any other type.
TFTF_HD bool iq_encode_block(int ty, const float* x, const float* qw, const u8* tables, u8* y) {
    switch (ty) {
        case KQ_IQ2_XXS: kq_iq2_xxs(x, qw, tables, y); return true;
        case KQ_IQ2_XS: kq_iq2_xs(x, qw, tables, y); return true;
        case KQ_IQ2_S: kq_iq2_s(x, qw, tables, y); return true;
        case KQ_IQ3_XXS: kq_iq3_xxs(x, qw, tables, y); return true;
        case KQ_IQ3_S: kq_iq3_s(x, qw, tables, y); return true;
        case KQ_IQ1_S: kq_iq1_s(x, qw, tables, y); return true;
        case KQ_IQ1_M: kq_iq1_m(x, qw, tables, y); return true;
    }
    return false;
}
