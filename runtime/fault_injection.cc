#include "runtime/fault_injection.h"

#include <cerrno>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ps {
namespace {

absl::Status BadRule(absl::string_view rule, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("fault injection spec: rule '", rule, "': ", why,
                   " (expected site[:after=N][:count=K][:p=P][:seed=S][:errno=E][:short=1] with "
                   "site copy, nvme_read, nvme_write, nvme or any)"));
}

}  // namespace

absl::StatusOr<std::shared_ptr<FaultInjector>> FaultInjector::Parse(absl::string_view spec) {
  spec = absl::StripAsciiWhitespace(spec);
  if (spec.empty()) return std::shared_ptr<FaultInjector>();
  auto injector = std::shared_ptr<FaultInjector>(new FaultInjector(std::string(spec)));
  absl::MutexLock lock(&injector->mutex_);
  for (absl::string_view text : absl::StrSplit(spec, ';', absl::SkipWhitespace())) {
    text = absl::StripAsciiWhitespace(text);
    std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
    Rule rule;
    const absl::string_view site = parts[0];
    if (site == "copy" || site == "any") rule.sites[0] = true;
    if (site == "nvme_read" || site == "nvme" || site == "any") rule.sites[1] = true;
    if (site == "nvme_write" || site == "nvme" || site == "any") rule.sites[2] = true;
    if (!rule.sites[0] && !rule.sites[1] && !rule.sites[2]) {
      return BadRule(text, absl::StrCat("unknown site '", site, "'"));
    }
    uint64_t seed = 1;
    for (size_t i = 1; i < parts.size(); ++i) {
      std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(parts[i], '=');
      bool ok = true;
      if (kv.first == "after") {
        ok = absl::SimpleAtoi(kv.second, &rule.after) && rule.after >= 0;
      } else if (kv.first == "count") {
        ok = absl::SimpleAtoi(kv.second, &rule.count) && rule.count >= 0;
      } else if (kv.first == "p") {
        ok = absl::SimpleAtod(kv.second, &rule.probability) && rule.probability >= 0 &&
             rule.probability <= 1;
      } else if (kv.first == "seed") {
        ok = absl::SimpleAtoi(kv.second, &seed);
      } else if (kv.first == "errno") {
        ok = absl::SimpleAtoi(kv.second, &rule.error) && rule.error > 0;
      } else if (kv.first == "short") {
        int value = 0;
        ok = absl::SimpleAtoi(kv.second, &value);
        rule.short_transfer = value != 0;
      } else {
        return BadRule(text, absl::StrCat("unknown key '", kv.first, "'"));
      }
      if (!ok) return BadRule(text, absl::StrCat("bad value for '", kv.first, "'"));
    }
    rule.random.seed(seed);
    injector->rules_.push_back(std::move(rule));
  }
  return injector;
}

IoFault FaultInjector::Next(FaultSite site, int64_t bytes) {
  absl::MutexLock lock(&mutex_);
  for (Rule& rule : rules_) {
    if (!rule.sites[static_cast<int>(site)]) continue;
    const int64_t index = rule.seen++;
    bool fail;
    if (rule.probability >= 0) {
      fail = std::uniform_real_distribution<double>(0.0, 1.0)(rule.random) < rule.probability;
    } else {
      fail = index >= rule.after && (rule.count == 0 || index < rule.after + rule.count);
    }
    if (!fail) continue;
    ++injected_;
    if (rule.short_transfer && site != FaultSite::kCopy) return IoFault{0, bytes / 2};
    return IoFault{rule.error, -1};
  }
  return IoFault{};
}

int64_t FaultInjector::injected() const {
  absl::MutexLock lock(&mutex_);
  return injected_;
}

IoFaultInjector NvmeFaultHook(std::shared_ptr<FaultInjector> injector) {
  return [injector](IoOp op, int64_t /*file_offset*/, int64_t bytes) {
    return injector->Next(op == IoOp::kRead ? FaultSite::kNvmeRead : FaultSite::kNvmeWrite,
                          bytes);
  };
}

}  // namespace ps
