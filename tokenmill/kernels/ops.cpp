// The smaller kernels as one translation unit: compiled alone, each of them spent about 8 of its 10 seconds parsing
// torch's headers (measured, g++ 12 -O3). quant.cpp, the largest, compiles beside this one, so a build takes about
// as long as quant.cpp alone on two cores or more, and half the CPU time it did.

#include "norm.cpp"
#include "rope.cpp"
#include "attention.cpp"
#include "attention_prefill.cpp"  // after attention.cpp, whose decode kernel it falls back on
#include "collectives.cpp"  // before layer.cpp, whose fused layer all-reduces across tensor-parallel ranks
#include "layer.cpp"
#include "tiles.cpp"
#include "lora.cpp"
#include "sample.cpp"
#include "threads.cpp"
