#include "codec/det_math.h"

namespace kvtrie {
namespace internal {

double DetExp(double y) {
  const double z = y / 4096.0;
  double term = 1, sum = 1;
  for (int k = 1; k < 12; ++k) sum += term *= z / k;
  for (int k = 0; k < 12; ++k) sum *= sum;
  return sum;
}

void DetCosSin(double a, double* c, double* s) {
  double term = 1, cs = 1, sn = 0;
  for (int k = 1; k < 24; ++k) {
    term *= a / k;
    switch (k % 4) {
      case 1:
        sn += term;
        break;
      case 2:
        cs -= term;
        break;
      case 3:
        sn -= term;
        break;
      default:
        cs += term;
        break;
    }
  }
  *c = cs;
  *s = sn;
}

}  // namespace internal
}  // namespace kvtrie
