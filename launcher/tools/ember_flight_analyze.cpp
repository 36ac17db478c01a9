// ember_flight_analyze DIR: reads the flight recorder's dumps of every rank of a job
// (DIR/flight_rank<R>.json, distributed/flight_recorder.h) and names, for each process group,
// the first collective where the ranks diverge: a rank that skipped one, a size or dtype
// mismatch, ranks that never reached one the others wait in, or ranks stuck in one.
//
// Exit status: 0 no divergence found, 1 divergence found (printed), 2 bad input (the missing,
// unreadable or malformed dump is named).
#include <cstdio>

#include <CLI/CLI.hpp>

#include <ember/launcher/flight_analysis.h>

int main(int argc, char** argv) {
  CLI::App app{"Compares the flight recorder's dumps of all ranks (EMBER_FLIGHT_RECORDER_DIR) "
               "and names the first collective where they diverge"};
  std::string dir;
  app.add_option("dir", dir, "Folder holding the ranks' flight_rank<R>.json files")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  ember::launcher::FlightReport report;
  try {
    report = ember::launcher::analyze_flight_dumps(dir);
  } catch (const ember::launcher::FlightDumpError& e) {
    std::fprintf(stderr, "ember_flight_analyze: bad input: %s\n", e.what());
    return 2;
  }
  std::printf("read %zu dump%s from %s\n", report.files.size(), report.files.size() == 1 ? "" : "s",
              dir.c_str());
  if (report.findings.empty()) {
    std::printf("no divergence: every group's ranks issued the same collectives and completed "
                "them\n");
    return 0;
  }
  for (const auto& f : report.findings) std::printf("%s\n", f.message.c_str());
  return 1;
}
