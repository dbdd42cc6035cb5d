// The dashboard's static files (head/dashboard/: pages, scripts, styles), compiled into the binary: the build
// turns each file into bytes in a generated dashboard_assets.cc (head/dashboard/embed.cmake), so the head serves
// them with no files on disk and no web server.
//
//   const DashboardAsset* asset = FindDashboardAsset("cluster.html");   // null when there is none by that name
//
// The table is constant: thread-safe.
#pragma once

#include <cstddef>
#include <string_view>

namespace geotrain::head {

struct DashboardAsset {
  const char* name;          // the file's name in head/dashboard/ ("job.js")
  const char* content_type;  // from its extension ("text/javascript; charset=utf-8")
  const unsigned char* data;
  size_t size;
};

// The asset named `name` (a plain file name: no directories), or null.
const DashboardAsset* FindDashboardAsset(std::string_view name);

}  // namespace geotrain::head
