// The state behind a movable public class (its Impl). A moved-from object has none: any use of it
// but destruction or assignment is a std::logic_error naming the class, not a null dereference.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>

namespace ciera {

template <class Impl>
Impl& live_state(const std::unique_ptr<Impl>& impl, const char* owner) {
  if (!impl) {
    throw std::logic_error(std::string(owner) +
                           ": used after it was moved from (a moved-from object may only be "
                           "destroyed or assigned to)");
  }
  return *impl;
}

}  // namespace ciera
