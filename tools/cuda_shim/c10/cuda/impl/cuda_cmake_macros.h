// Stand-in for the header that CUDA builds of torch generate; the CPU wheel lacks it.
#pragma once
