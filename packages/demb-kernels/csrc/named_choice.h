// The enum value a string argument of an op names (optimizer, mode, dist_type), shared by the
// ops' argument checks.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <string_view>

namespace demb {

template <typename E>
struct NamedChoice {
  std::string_view name;
  E value;
};

// The value of the choice called `name`; else a ValueError "<arg>='<name>': <expected>".
template <typename E, size_t N>
E parse_choice(std::string_view name, const NamedChoice<E> (&choices)[N], const char* arg,
               const char* expected) {
  for (const NamedChoice<E>& c : choices) {
    if (c.name == name) return c.value;
  }
  TORCH_CHECK_VALUE(false, arg, "='", name, "': ", expected);
}

}  // namespace demb
