-- wrk script: the peer harness's wrk_post.lua (WRK_BASE: its path; it sets the method,
-- path, headers, the WRK_BODY body and the JSON summary), with a request number put at
-- the start of the last message's content, so no two requests carry the same prompt and
-- nothing the gateway could cache by whole prompt text is ever hit twice (earlier
-- messages, a shared system prompt, stay the same).
dofile(os.getenv("WRK_BASE"))

local counter = 0
request = function()
  counter = counter + 1
  local body = wrk.body:gsub('^(.*"content":%s*")', '%1Request ' .. counter .. ': ', 1)
  return wrk.format(nil, nil, nil, body)
end
